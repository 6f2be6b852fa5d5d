// Job page: live per-step curves (from the metrics endpoint's pages), each node's memory peaks, hyperparameters and
// precision, the event log, checkpoints with downloads, cancel / pause / resume, and the error of a failed job.

import { MetricsStream, downloadCheckpoint, jobs } from "../api.js";
import { METRIC_CHARTS, PALETTE, StepChart, isValidation, valueOf } from "../charts.js";
import {
  FINISHED_STATUSES,
  errorBox,
  formatAttempts,
  formatBytes,
  formatCount,
  formatDuration,
  formatNumber,
  formatTime,
  h,
  jobDuration,
  replaceChildren,
  statusBadge,
} from "../dom.js";
import { poll } from "./poll.js";

const RUNNING_REFRESH_MS = 1500;
// A finished job's page still looks now and then: a cancelled trainer may report its last step after the
// status changed.
const FINISHED_REFRESH_MS = 10000;
const EVENTS_SHOWN = 200;

const ACTIONS = [
  ["cancel", "Cancel", ["validating_files", "queued", "running", "paused"]],
  ["pause", "Pause", ["queued", "running"]],
  ["resume", "Resume", ["paused"]],
];

export function render(main, [jobId]) {
  const title = h("h1", { id: "job-title" }, jobId);
  const status = h("span", { id: "job-status" });
  const actionError = h("div", { id: "job-action-error" });
  const buttons = ACTIONS.map(([verb, label]) => {
    const button = h("button", { type: "button", id: `job-${verb}`, disabled: true }, label);
    button.addEventListener("click", () => act(verb, button));
    return button;
  });
  const errorPanel = h("div", { id: "job-error" });
  const progress = h("p", { id: "job-progress", class: "muted" });
  const summary = h("dl", { id: "job-summary", class: "facts" });
  const hyper = h("tbody");
  const chartGrid = h("div", { class: "chart-grid", id: "job-charts" });
  const nodeMemory = h("tbody");
  const nodeMemoryStep = h("p", { class: "muted", id: "job-node-memory-step" });
  const events = h("tbody");
  const checkpoints = h("tbody");
  const evalRuns = h("tbody");
  const downloadStatus = h("div", { id: "download-status", class: "muted" });
  const pageError = h("div", { id: "job-page-error" });

  replaceChildren(
    main,
    pageError,
    h("div", { class: "title-row" }, h("div", {}, title, status), h("div", { class: "actions" }, buttons)),
    actionError,
    errorPanel,
    progress,
    h("section", { class: "columns" },
      h("div", {}, h("h2", {}, "Job"), summary),
      h("div", {}, h("h2", {}, "Hyperparameters"),
        h("table", { class: "data compact", id: "job-hyperparameters" }, h("thead", {}, h("tr", {}, h("th", {}, "name"), h("th", {}, "value"))), hyper))),
    h("h2", {}, "Metrics per step"),
    chartGrid,
    h("h2", {}, "Memory per node"),
    nodeMemoryStep,
    h("table", { class: "data compact", id: "job-node-memory" },
      h("thead", {}, h("tr", {}, ["Node", "Host", "Ranks", "Peak allocated", "Peak reserved", "Allocated per rank"].map((c) => h("th", {}, c)))),
      nodeMemory),
    h("h2", {}, "Checkpoints"),
    h("table", { class: "data", id: "job-checkpoints" },
      h("thead", {}, h("tr", {}, ["Step", "Saved", "Train loss", "Valid loss", "Valid accuracy", "Model", "Download"].map((c) => h("th", {}, c)))),
      checkpoints),
    downloadStatus,
    h("h2", {}, "Eval runs of the fine-tuned model"),
    h("table", { class: "data", id: "job-eval-runs" },
      h("thead", {}, h("tr", {}, ["Run", "Eval", "Status", "Passed", "Per criterion", "Created"].map((c) => h("th", {}, c)))),
      evalRuns),
    h("h2", {}, "Events"),
    h("table", { class: "data compact", id: "job-events" },
      h("thead", {}, h("tr", {}, ["Time", "Level", "Message"].map((c) => h("th", {}, c)))), events),
  );

  const charts = METRIC_CHARTS.map((spec) => {
    const box = h("div", { class: "chart-box" });
    chartGrid.append(box);
    const chart = new StepChart(box, {
      name: spec.name,
      title: spec.title,
      format: spec.format,
      series: spec.metrics.map(([name, label], i) => ({ label, color: PALETTE[i], points: isValidation(name) ? true : undefined })),
    });
    const note = h("p", { class: "muted chart-note" });
    box.append(note);
    return { spec, chart, note };
  });

  const stream = new MetricsStream(jobId);
  let job = null;
  let stopped = false;

  function drawCharts() {
    const points = stream.points;
    const steps = points.map((p) => p.step);
    for (const { spec, chart, note } of charts) {
      const columns = spec.metrics.map(([name]) => points.map((p) => valueOf(p, name)));
      chart.setData(steps, columns);
      const reported = columns.some((column) => column.some((v) => v !== null));
      note.textContent = points.length && !reported
        ? spec.name === "mfu" ? "Not reported: the device's peak FLOP/s is unknown (CPU)." : "Not reported."
        : "";
    }
  }

  // The newest step's peaks, one line per node: its ranks' largest (the one that runs out first) and each rank's.
  function drawNodeMemory() {
    const last = [...stream.points].reverse().find((p) => p.rank_memory && p.rank_memory.length);
    nodeMemoryStep.textContent = last ? `Step ${last.step}.` : "Not reported yet.";
    const nodes = new Map();
    for (const entry of last ? last.rank_memory : []) {
      if (!nodes.has(entry.node)) nodes.set(entry.node, []);
      nodes.get(entry.node).push(entry);
    }
    const largest = (ranks, name) => Math.max(...ranks.map((r) => r[name]));
    replaceChildren(nodeMemory, [...nodes.entries()].map(([node, ranks]) =>
      h("tr", { dataset: { node: String(node) } },
        h("td", {}, String(node)),
        h("td", { class: "host" }, ranks[0].host),
        h("td", { class: "ranks" }, ranks.map((r) => r.rank).join(", ")),
        h("td", { class: "allocated" }, formatBytes(largest(ranks, "peak_memory_allocated_bytes"))),
        h("td", { class: "reserved" }, formatBytes(largest(ranks, "peak_memory_reserved_bytes"))),
        h("td", { class: "per-rank" }, ranks.map((r) => `${r.rank}: ${formatBytes(r.peak_memory_allocated_bytes)}`).join(" · ")))));
  }

  function drawJob(started) {
    replaceChildren(status, statusBadge(job.status));
    status.dataset.status = job.status;
    for (const [i, [, , allowed]] of ACTIONS.entries()) buttons[i].disabled = !allowed.includes(job.status);
    replaceChildren(errorPanel, job.error
      ? errorBox(`Failed: ${job.error.message}${job.error.code ? ` (${job.error.code})` : ""}`)
      : null);

    const hp = job.hyperparameters || {};
    // What ran: the job object's `resolved` (the trainer's own account, kept on the job), else the started event.
    const ran = job.resolved || started;
    const precision = ran && ran.precision ? ran.precision : hp.precision || "chosen by the trainer at start";
    const fact = (name, value, id) => [h("dt", {}, name), h("dd", id ? { id } : {}, value)];
    replaceChildren(summary,
      job.status_details ? fact("Waiting", job.status_details, "job-status-details") : null,
      fact("Model", job.model),
      fact("Method", (job.method && job.method.type) || "supervised"),
      fact("Precision", precision, "job-precision"),
      ran ? fact("Trained on", `${ran.world_size} × ${ran.device}, ${ran.distributed}, kernels ${ran.kernels ? "on" : "off"}`, "job-trained-on") : null,
      ran ? fact("Micro-batch", `${ran.micro_batch_size} × ${ran.grad_accum_steps} accumulation step(s) per GPU`, "job-micro-batch") : null,
      ran && ran.memory_plan_description ? fact("Memory plan", ran.memory_plan_description, "job-memory-plan") : null,
      fact("Fine-tuned model", job.fine_tuned_model || "—"),
      fact("Training file", job.training_file),
      fact("Validation file", job.validation_file || "—"),
      fact("Created", formatTime(job.created_at)),
      fact("Started", formatTime(job.attempts && job.attempts.length ? job.attempts[0].started_at : job.started_at)),
      fact("Finished", formatTime(job.finished_at)),
      fact("Estimated finish", estimatedFinish(job), "job-eta"),
      fact("Results file", job.result_files && job.result_files.length ? job.result_files.join(", ") : "—", "job-result-files"),
      fact("Training time", formatDuration(jobDuration(job)), "job-training-time"),
      fact("Attempts", formatAttempts(job.attempts), "job-attempts"),
      fact("Trained tokens", formatCount(job.trained_tokens), "job-trained-tokens"),
      fact("Seed", job.seed),
    );
    replaceChildren(hyper, flatten(hp).map(([name, value]) => h("tr", {}, h("td", {}, name), h("td", {}, formatNumber(value)))));

    const last = stream.points[stream.points.length - 1];
    const total = started && started.total_steps;
    const parts = [];
    if (last) parts.push(`step ${last.step}${total ? ` of ${total}` : ""}`);
    if (last && job.status === "running" && last.values && last.values.eta_s != null) parts.push(`about ${formatDuration(last.values.eta_s)} left`);
    progress.textContent = parts.join(" · ");
  }

  function drawEvents(list) {
    replaceChildren(events, list.map((e) =>
      h("tr", { class: `level-${e.level}` }, h("td", { class: "nowrap" }, formatTime(e.created_at)), h("td", {}, e.level), h("td", {}, e.message))));
  }

  // Each run's pass rate over the items it graded, and each testing criterion's.
  function drawEvalRuns(list) {
    const rate = (passed, failed) => (passed + failed ? `${passed}/${passed + failed} (${Math.round((100 * passed) / (passed + failed))}%)` : "—");
    replaceChildren(evalRuns, list.length ? list.map((r) => {
      const counts = r.result_counts;
      const criteria = r.per_testing_criteria_results.map((c) => `${c.testing_criteria}: ${rate(c.passed, c.failed)}`).join("; ");
      return h("tr", { dataset: { runId: r.id } },
        h("td", {}, r.name || r.id),
        h("td", {}, r.eval_id),
        h("td", {}, r.status === "failed" && r.error ? `failed: ${r.error.message}` : r.status),
        h("td", { class: "eval-pass-rate" }, rate(counts.passed, counts.failed + counts.errored)),
        h("td", {}, criteria || "—"),
        h("td", {}, formatTime(r.created_at)));
    }) : [h("tr", {}, h("td", { colspan: 6, class: "muted" }, "No eval run of this job's model yet (POST /v1/evals/{id}/runs)."))]);
  }

  function drawCheckpoints(list) {
    replaceChildren(checkpoints, list.map((c) => {
      const download = (withState) => {
        const button = h("button", { type: "button", class: "download", dataset: { checkpointId: c.id, trainingState: String(withState) } },
          withState ? "with training state" : "Download");
        button.addEventListener("click", () => download_(c, withState, button));
        return button;
      };
      // OpenAI's checkpoint metrics: full_valid_* over the whole validation file; a preference job's accuracy
      // is its reward accuracy. The best checkpoint of a job that stopped early is marked.
      const m = c.metrics || {};
      const accuracy = m.full_valid_mean_token_accuracy ?? m.full_valid_reward_accuracy;
      return h("tr", { dataset: { checkpointId: c.id, best: String(Boolean(c.best)) } },
        h("td", {}, c.best ? `${c.step_number} (best)` : c.step_number),
        h("td", {}, formatTime(c.created_at)),
        h("td", {}, formatNumber(m.train_loss)),
        h("td", { class: "valid-loss" }, formatNumber(m.full_valid_loss ?? m.valid_loss)),
        h("td", { class: "valid-accuracy" }, accuracy == null ? "—" : `${(accuracy * 100).toFixed(1)}%`),
        h("td", {}, c.fine_tuned_model_checkpoint),
        h("td", { class: "nowrap" }, download(false), " ", download(true)));
    }));
  }

  async function download_(checkpoint, withState, button) {
    button.disabled = true;
    downloadStatus.textContent = `Downloading step ${checkpoint.step_number}…`;
    try {
      const { filename, bytes } = await downloadCheckpoint(jobId, checkpoint.id, {
        includeTrainingState: withState,
        onProgress: (received, total) => {
          downloadStatus.textContent = `Downloading step ${checkpoint.step_number}: ${formatBytes(received)}${total ? ` of ${formatBytes(total)}` : ""}`;
        },
      });
      downloadStatus.textContent = `Saved ${filename} (${formatBytes(bytes)}).`;
      downloadStatus.dataset.saved = filename;
    } catch (error) {
      replaceChildren(downloadStatus, errorBox(`Download failed: ${error.message}`));
    } finally {
      button.disabled = false;
    }
  }

  async function act(verb, button) {
    if (verb === "cancel" && !window.confirm(`Cancel job ${jobId}? It cannot be resumed.`)) return;
    button.disabled = true;
    replaceChildren(actionError);
    try {
      job = await jobs.action(jobId, verb);
      drawJob(null);
    } catch (error) {
      replaceChildren(actionError, errorBox(`${verb} failed: ${error.message}`));
    }
    if (!stopped) refreshNow();
  }

  async function refresh() {
    try {
      job = await jobs.get(jobId);
    } catch (error) {
      replaceChildren(pageError, errorBox(error.message));
      main.classList.add("not-found");
      for (const section of main.children) if (section !== pageError) section.hidden = true;
      return false;
    }
    const [, eventPage, checkpointPage, evalRunPage] = await Promise.all([
      stream.poll(),
      jobs.events(jobId, { type: "message", limit: EVENTS_SHOWN }),
      jobs.checkpoints(jobId),
      jobs.evalRuns(jobId),
    ]);
    const startedEvent = eventPage.data.find((e) => e.data && e.data.event === "started");
    drawCharts();
    drawNodeMemory();
    drawJob(startedEvent ? startedEvent.data : null);
    drawEvents(eventPage.data);
    drawCheckpoints(checkpointPage.data);
    drawEvalRuns(evalRunPage.data);
    return FINISHED_STATUSES.has(job.status) ? FINISHED_REFRESH_MS : RUNNING_REFRESH_MS;
  }

  let stopPolling = poll(refresh, RUNNING_REFRESH_MS);
  function refreshNow() {
    stopPolling();
    stopPolling = poll(refresh, RUNNING_REFRESH_MS);
  }

  return () => {
    stopped = true;
    stopPolling();
    for (const { chart } of charts) chart.destroy();
  };
}

/** When a running job should end (the job object's estimated_finish, from its measured step times). */
function estimatedFinish(job) {
  if (job.status !== "running" || job.estimated_finish == null) return "—";
  const left = Math.max(0, job.estimated_finish - Date.now() / 1000);
  return `${formatTime(job.estimated_finish)} (in about ${formatDuration(left)})`;
}

/** {"lora": {"r": 8}} -> [["lora.r", 8]] */
function flatten(object, prefix = "") {
  return Object.entries(object).flatMap(([name, value]) =>
    value && typeof value === "object" && !Array.isArray(value)
      ? flatten(value, `${prefix}${name}.`)
      : [[`${prefix}${name}`, Array.isArray(value) ? value.join(", ") : value === null ? "—" : value]]);
}
