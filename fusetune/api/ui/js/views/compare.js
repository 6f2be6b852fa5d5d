// Compare view: several jobs' per-step curves overlaid (loss, tokens/s, MFU, peak memory), e.g. the same job
// with the kernels on and off, with a summary row per job.

import { MetricsStream, jobs } from "../api.js";
import { METRIC_CHARTS, PALETTE, StepChart, alignOnSteps, valueOf } from "../charts.js";
import { FINISHED_STATUSES, errorBox, formatBytes, formatCount, formatNumber, h, hashQuery, replaceChildren, setHashQuery, statusBadge } from "../dom.js";
import { poll } from "./poll.js";

const RUNNING_REFRESH_MS = 2000;
const FINISHED_REFRESH_MS = 10000;

export function render(main) {
  const chosen = (hashQuery().get("jobs") || "").split(",").filter(Boolean);
  const picker = h("div", { class: "picker", id: "compare-picker" });
  const problems = h("div", { id: "compare-error" });
  const table = h("tbody");
  const chartGrid = h("div", { class: "chart-grid", id: "compare-charts" });
  replaceChildren(
    main,
    h("h1", {}, "Compare jobs"),
    h("details", { open: chosen.length < 2 }, h("summary", {}, "Choose jobs"), picker),
    problems,
    h("table", { class: "data", id: "compare-table" },
      h("thead", {}, h("tr", {}, ["", "Job", "Status", "Model", "Kernels", "Steps", "Last train loss", "Median tokens/s", "Max peak memory"].map((c) => h("th", {}, c)))),
      table),
    chartGrid,
  );

  jobs.list({ limit: 100 }).then((list) => {
    const ids = new Set(chosen);
    replaceChildren(picker, list.data.map((job) => {
      const box = h("input", { type: "checkbox", value: job.id, checked: ids.has(job.id) });
      box.addEventListener("change", () => {
        if (box.checked) ids.add(job.id);
        else ids.delete(job.id);
        setHashQuery("#/compare", { jobs: [...ids].join(",") });
      });
      return h("label", { class: "pick" }, box, ` ${job.id} `, h("span", { class: "muted" }, `${job.model} · ${job.status}`));
    }));
  }, (error) => replaceChildren(picker, errorBox(error.message)));

  if (chosen.length === 0) {
    chartGrid.append(h("p", { class: "muted" }, "Pick two or more jobs."));
    return null;
  }

  const entries = chosen.map((id, i) => ({ id, color: PALETTE[i % PALETTE.length], stream: new MetricsStream(id), job: null }));
  // One series per job and metric; a second metric of a chart (validation loss, reserved memory) is dashed.
  const charts = METRIC_CHARTS.map((spec) => {
    const box = h("div", { class: "chart-box" });
    chartGrid.append(box);
    const series = entries.flatMap((entry) => spec.metrics.map(([, label], m) => ({
      label: `${entry.id.slice(-8)} ${label}`, color: entry.color, dash: m ? [6, 4] : undefined, points: m ? true : undefined,
    })));
    return { spec, chart: new StepChart(box, { name: spec.name, title: spec.title, format: spec.format, series }) };
  });

  function draw() {
    for (const { spec, chart } of charts) {
      const tables = entries.flatMap((entry) => spec.metrics.map(([name]) => ({
        steps: entry.stream.points.map((p) => p.step),
        values: entry.stream.points.map((p) => valueOf(p, name)),
      })));
      const { steps, columns } = alignOnSteps(tables);
      chart.setData(steps, columns);
    }
    replaceChildren(table, entries.map((entry) => {
      const points = entry.stream.points;
      const job = entry.job;
      const speeds = points.map((p) => valueOf(p, "tokens_per_second")).filter((v) => v !== null).sort((a, b) => a - b);
      const memory = Math.max(...points.map((p) => valueOf(p, "peak_memory_allocated_bytes") ?? -Infinity));
      return h("tr", { dataset: { jobId: entry.id } },
        h("td", {}, h("span", { class: "swatch", style: null, dataset: { color: entry.color } })),
        h("td", {}, h("a", { href: `#/jobs/${encodeURIComponent(entry.id)}` }, entry.id)),
        h("td", {}, job ? statusBadge(job.status) : "—"),
        h("td", {}, job ? job.model : "—"),
        h("td", {}, job && job.hyperparameters && "kernels" in job.hyperparameters ? (job.hyperparameters.kernels ? "on" : "off") : "—"),
        h("td", { class: "number" }, formatCount(points.length)),
        h("td", { class: "number" }, formatNumber(points.length ? valueOf(points[points.length - 1], "train_loss") : null)),
        h("td", { class: "number" }, speeds.length ? formatCount(Math.round(speeds[Math.floor(speeds.length / 2)])) : "—"),
        h("td", { class: "number" }, Number.isFinite(memory) ? formatBytes(memory) : "—"));
    }));
    for (const swatch of table.querySelectorAll(".swatch")) swatch.style.background = swatch.dataset.color;
  }

  async function refresh() {
    const failures = [];
    await Promise.all(entries.map(async (entry) => {
      try {
        entry.job = await jobs.get(entry.id);
        await entry.stream.poll();
      } catch (error) {
        failures.push(`${entry.id}: ${error.message}`);
      }
    }));
    replaceChildren(problems, failures.map((message) => errorBox(message)));
    draw();
    const running = entries.some((e) => e.job && !FINISHED_STATUSES.has(e.job.status));
    return running ? RUNNING_REFRESH_MS : FINISHED_REFRESH_MS;
  }

  const stop = poll(refresh, RUNNING_REFRESH_MS);
  return () => {
    stop();
    for (const { chart } of charts) chart.destroy();
  };
}
