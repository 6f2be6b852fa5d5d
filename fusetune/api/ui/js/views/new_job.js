// New job form: model, files, method and the hyperparameters. Which fields there are, their defaults, bounds and
// choices, the methods with their own settings and the precision modes all come from the server
// (/v1/fine_tuning/options, read from the job specification), so that one added or changed there shows here
// with no change to this file, which only words and orders them. Every change asks the server for a dry-run
// estimate (memory per GPU, time, whether it fits) and the data check of its files with an example's trained
// tokens highlighted, and the job can be created only once the estimate for exactly the values in the form has
// been shown.

import { ApiError, api, jobs } from "../api.js";
import { errorBox, formatBytes, formatCount, formatDuration, h, replaceChildren } from "../dom.js";
import { controlFor, field, labelFor, valueOf } from "../fields.js";

const ESTIMATE_DELAY_MS = 300;
// The page's wording of the options it knows, in the order it shows them ("lora.r": field r of lora; "dpo.beta":
// setting beta of method dpo). Options the server lists beyond these follow, in its order, named after the field.
const LABELS = {
  n_epochs: "Epochs",
  batch_size: "Batch size (sequences per step)",
  learning_rate_multiplier: "Learning rate multiplier",
  learning_rate: "Learning rate (instead of the multiplier)",
  max_seq_length: "Max sequence length",
  warmup_ratio: "Warmup ratio",
  lr_scheduler: "LR schedule",
  precision: "Precision",
  n_gpus: "GPUs",
  distributed: "Multi-GPU",
  kernels: "fusetune kernels",
  gradient_checkpointing: "Gradient checkpointing",
  packing: "Packing",
  lora: "LoRA",
  "lora.r": "LoRA rank",
  "lora.alpha": "LoRA alpha",
  "lora.dropout": "LoRA dropout",
  merge_lora_on_save: "Merge LoRA on save",
  "dpo.beta": "DPO beta",
  "dpo.loss_type": "DPO loss",
  "dpo.sft_weight": "DPO SFT weight",
};
const ORDER = Object.keys(LABELS);

/** An object's options as [name, option] pairs in the page's order (a stable sort keeps the server's otherwise). */
function ordered(options, prefix) {
  const rank = (name) => (ORDER.includes(prefix + name) ? ORDER.indexOf(prefix + name) : ORDER.length);
  return Object.entries(options).sort(([a], [b]) => rank(a) - rank(b));
}

/** The values of editable options as a request takes them; an object's only while its checkbox is ticked. */
function valuesOf(entries) {
  const values = {};
  for (const { name, option, control, fields } of entries) {
    const value = fields ? (control.checked ? valuesOf(fields) : undefined) : valueOf(option, control);
    if (value !== undefined) values[name] = value;
  }
  return values;
}

export function render(main) {
  const select = (id) => h("select", { id, name: id });
  const model = select("model");
  const trainingFile = select("training_file");
  const validationFile = select("validation_file");
  const method = select("method");
  const methodSettings = h("div", { id: "method-settings", class: "subfields" });
  const hyperparameterFields = h("div", { id: "hyperparameter-fields", class: "subfields" });
  const suffix = h("input", { type: "text", id: "suffix", maxlength: 64, pattern: "[A-Za-z0-9_-]+" });
  const seed = h("input", { type: "number", id: "seed", name: "seed", min: 0 });

  const estimatePanel = h("div", { id: "estimate", class: "estimate", "aria-live": "polite" }, h("p", { class: "muted" }, "Choose a model and a training file."));
  const submit = h("button", { type: "submit", id: "create-job", disabled: true }, "Create job");
  const submitError = h("div", { id: "create-error" });
  const form = h("form", { id: "new-job", class: "new-job" },
    h("fieldset", {}, h("legend", {}, "What to train"),
      field("Model", model), field("Training file", trainingFile), field("Validation file", validationFile), field("Method", method),
      methodSettings),
    h("fieldset", {}, h("legend", {}, "Hyperparameters"), hyperparameterFields, field("Suffix", suffix), field("Seed", seed)),
    h("div", { class: "side" }, h("h2", {}, "Estimate"), estimatePanel, submit, submitError));
  replaceChildren(main, h("h1", {}, "New fine-tuning job"), form);

  let options = null; // the server's answer: hyperparameters, methods, precisions
  let shared = []; // the editable shared hyperparameters: {name, option, control, rows, fields}
  let settings = []; // the same for the chosen method's own settings

  // A choice's label and tooltip where the server describes it (the precision modes).
  const describeChoice = (key) => (value) => {
    if (key !== "precision") return {};
    if (value === "auto") return { label: `auto: ${options.precision_auto.gpu}, on CPU ${options.precision_auto.cpu}`, title: "What auto means depends on the device the job trains on" };
    return { title: options.precisions[value]?.description };
  };
  // One editable option: its row, and for an object (lora) the entries of its own fields, shown while it is ticked.
  function entry(key, id, name, option) {
    const control = controlFor(id, option, describeChoice(key));
    if (!control) return null;
    const rows = [field(labelFor(LABELS, key, name), control, option.description)];
    let fields = null;
    if (option.fields) {
      fields = entries(option.fields, `${key}.`, `${id}_`);
      const show = () => fields.forEach((sub) => sub.rows.forEach((row) => { row.hidden = !control.checked; }));
      control.addEventListener("change", show);
      show();
      rows.push(...fields.flatMap((sub) => sub.rows));
    }
    return { name, option, control, rows, fields };
  }
  const entries = (all, keyPrefix, idPrefix) =>
    ordered(all, keyPrefix).map(([name, option]) => entry(keyPrefix + name, idPrefix + name, name, option)).filter(Boolean);

  function showMethod() {
    const chosen = options.methods[method.value];
    settings = entries(chosen.settings, `${method.value}.`, `${method.value}_`);
    replaceChildren(methodSettings, settings.flatMap((e) => e.rows));
    method.title = chosen.description;
    const packing = shared.find((e) => e.name === "packing");
    if (packing) {
      packing.control.disabled = !chosen.supports_packing;
      if (!chosen.supports_packing) packing.control.checked = false;
    }
    showFiles();
  }

  // Only files a job of the chosen method can train on: uploaded training files (purpose fine-tune, not a job's
  // results CSV) whose line format is the method's. The choice made stays while it is still usable.
  let files = null; // the tenant's files, once loaded
  function showFiles() {
    if (!files || !options) return;
    const format = options.methods[method.value].example_format;
    const usable = files.filter((f) => f.purpose === "fine-tune" && options.methods[f.method]?.example_format === format);
    const items = usable.map((f) => [f.id, `${f.filename} (${f.id}, ${formatCount(f.example_count)} examples)`]);
    for (const [control, empty] of [[trainingFile, null], [validationFile, "none"]]) {
      const kept = control.value;
      optionsFor(control, items, empty ?? (items.length ? null : `no ${format} training files: upload one on the Files page`));
      if (items.some(([id]) => id === kept)) control.value = kept;
    }
  }
  // Before the form-wide listeners (the element's own listener runs first), so the estimate sees the new settings.
  method.addEventListener("change", showMethod);

  function build(answer) {
    options = answer;
    replaceChildren(method, Object.entries(answer.methods).map(([type, m]) =>
      h("option", { value: type, title: m.description, selected: type === answer.default_method }, type)));
    shared = entries(answer.hyperparameters, "", "");
    replaceChildren(hyperparameterFields, shared.flatMap((e) => e.rows));
    showMethod();
  }

  const optionsFor = (control, items, empty) => {
    replaceChildren(control, empty ? h("option", { value: "" }, empty) : null, items.map(([value, label]) => h("option", { value }, label)));
  };
  const loaded = Promise.all([
    api("v1/models").then((list) => optionsFor(model, list.data.map((m) => [m.id, m.id]))),
    api("v1/files").then((list) => { files = list.data; }),
    api("v1/fine_tuning/options").then(build),
  ]).then(showFiles).catch((error) => replaceChildren(estimatePanel, errorBox(error.message)));

  function body() {
    const hyperparameters = { ...valuesOf(shared), ...valuesOf(settings) };
    const request = {
      model: model.value,
      training_file: trainingFile.value,
      method: { type: method.value, [method.value]: { hyperparameters } },
    };
    if (validationFile.value) request.validation_file = validationFile.value;
    if (suffix.value) request.suffix = suffix.value;
    if (seed.value !== "") request.seed = Number(seed.value);
    return request;
  }

  let estimatedFor = null; // the request body (as JSON) whose estimate is on screen
  let timer = null;
  let generation = 0;
  async function estimate() {
    const request = body();
    const text = JSON.stringify(request);
    const mine = ++generation;
    submit.disabled = true;
    if (!request.model || !request.training_file) return;
    replaceChildren(estimatePanel, h("p", { class: "muted" }, "Estimating…"));
    try {
      const result = await api("v1/fine_tuning/jobs", { method: "POST", json: { ...request, dry_run: true } });
      if (mine !== generation) return;
      showEstimate(result);
    } catch (error) {
      if (mine !== generation) return;
      replaceChildren(estimatePanel, errorBox(error.message));
      if (!(error instanceof ApiError) || error.status >= 500 || error.param !== "model") {
        requestedFor = null; // the next change asks again
        return;
      }
    }
    // A model without a local config gets no estimate but may still be trained; anything else wrong with the
    // request is shown above and would be refused the same way on creation.
    estimatedFor = text;
    submit.disabled = false;
  }

  function showEstimate(e) {
    const fits = e.fits === null ? "unknown (the server has no GPU memory size set)" : e.fits ? "yes" : "no — it would be refused";
    const row = (name, value, id, part) => h("tr", {}, h("th", part ? { class: "part" } : {}, name), h("td", id ? { id } : {}, value));
    replaceChildren(estimatePanel, h("table", { class: "data compact", dataset: { fits: String(e.fits) } },
      row("Training tokens", formatCount(e.training_tokens), "estimate-tokens"),
      row("Steps", formatCount(e.steps), "estimate-steps"),
      row("Parameters", formatCount(e.parameters)),
      row("Memory plan", e.plan_description || "—", "estimate-plan"),
      row("Peak memory per GPU", formatBytes(e.peak_memory_bytes_per_gpu), "estimate-memory"),
      Object.entries(e.memory_breakdown || {}).map(([part, bytes]) => row(part.replaceAll("_", " "), formatBytes(bytes), null, true)),
      row("GPU memory", e.gpu_memory_bytes ? formatBytes(e.gpu_memory_bytes) : "not set"),
      row("Fits", fits, "estimate-fits"),
      e.refusal ? row("Refused because", e.refusal, "estimate-refusal") : null,
      e.checkpoint_disk_bytes ? row("Checkpoint disk", `${formatBytes(e.checkpoint_disk_bytes)} (${e.checkpoints_on_disk} × ${formatBytes(e.checkpoint_bytes)}), ${e.disk_free_bytes !== null ? formatBytes(e.disk_free_bytes) + " free" : "free space unknown"}`, "estimate-disk") : null,
      row("Time", e.duration_s !== null ? formatDuration(e.duration_s) : "unknown until this server has trained the model", "estimate-duration"),
      row("Throughput", e.tokens_per_second ? `${formatCount(Math.round(e.tokens_per_second))} tokens/s (${e.throughput_source})` : e.throughput_source)),
      dataCheck(e.data_check));
  }

  let requestedFor = null; // the body of the latest estimate asked for
  const scheduleEstimate = () => {
    // A blur fires "change" with nothing changed (as when the Create button is clicked): keep the estimate.
    const text = JSON.stringify(body());
    if (text === requestedFor) return;
    requestedFor = text;
    submit.disabled = true;
    generation += 1; // an estimate still on its way is for an older body: it must not enable Create
    clearTimeout(timer);
    timer = setTimeout(estimate, ESTIMATE_DELAY_MS);
  };
  form.addEventListener("input", scheduleEstimate);
  form.addEventListener("change", scheduleEstimate);
  loaded.then(scheduleEstimate);

  let idempotency = { body: null, key: null };
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    const request = body();
    const text = JSON.stringify(request);
    if (text !== estimatedFor) return;  // the button is enabled only for the estimated body
    // A retried click sends the same key, so a slow answer never creates the job twice.
    if (idempotency.body !== text) idempotency = { body: text, key: randomKey() };
    submit.disabled = true;
    replaceChildren(submitError);
    try {
      const job = await jobs.create(request, idempotency.key);
      window.location.hash = `#/jobs/${encodeURIComponent(job.id)}`;
    } catch (error) {
      replaceChildren(submitError, errorBox(error.message));
      submit.disabled = false;
    }
  });

  return () => clearTimeout(timer);
}

// The data check of the files (fusetune/tokenization/check.py): whether the job would be refused for it, and an
// example as the model sees it (the failing one, else the first), its trained stretches highlighted.
const DATA_CHECK_STATUS = {
  passed: "passed",
  failed: "failed — creating the job would be refused",
  not_checked: "not checked here",
};

function dataCheck(check) {
  if (!check) return null;
  const status = h("p", { id: "data-check-status", class: check.status === "failed" ? "warn" : check.status === "passed" ? "ok" : "muted", dataset: { status: check.status } },
    `Data check: ${DATA_CHECK_STATUS[check.status] || check.status}`, check.reason ? ` (${check.reason})` : "");
  const counts = check.files.map((f) => h("p", { class: "muted" },
    `${f.param}: ${formatCount(f.examples_checked)} examples checked${f.all_examples_checked ? " (all)" : " (the first)"}` +
    `, ${formatCount(f.examples_truncated)} longer than max_seq_length, ${formatCount(f.examples_without_trained_tokens)} cut to no trained token`));
  const failure = check.failure
    ? h("p", { id: "data-check-failure", class: "warn" },
      `${check.failure.check} failed at ${check.failure.param} line ${check.failure.line}: ${check.failure.problem}`)
    : null;
  const preview = check.preview
    ? h("div", { class: "data-preview" },
      h("p", { class: "muted" }, `Line ${check.preview.line} as the model sees it; trained tokens highlighted:`),
      check.preview.sequences.map((sequence) => h("pre", { class: "tokens", dataset: { label: sequence.label } },
        check.preview.sequences.length > 1 ? h("span", { class: "muted" }, `${sequence.label}: `) : null,
        sequence.segments.map((segment) => (segment.trained ? h("mark", { class: "trained" }, segment.text) : segment.text)))))
    : null;
  return h("section", { id: "data-check", dataset: { status: check.status } }, status, failure, counts, preview);
}

function randomKey() {
  const bytes = crypto.getRandomValues(new Uint8Array(16));
  return `ui-${Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("")}`;
}
