// New job form: model, files, method and the common hyperparameters. Every change asks the server for a
// dry-run estimate (memory per GPU, time, whether it fits), and the job can be created only once the estimate
// for exactly the values in the form has been shown.

import { ApiError, api, jobs } from "../api.js";
import { errorBox, formatBytes, formatCount, formatDuration, h, replaceChildren } from "../dom.js";

const ESTIMATE_DELAY_MS = 300;

export function render(main) {
  const field = (label, control, hint) => h("label", { class: "field" }, h("span", {}, label), control, hint ? h("small", { class: "muted" }, hint) : null);
  const select = (id) => h("select", { id, name: id });
  const number = (id, attrs) => h("input", { type: "number", id, name: id, ...attrs });
  const check = (id, checked) => h("input", { type: "checkbox", id, name: id, checked });

  const model = select("model");
  const trainingFile = select("training_file");
  const validationFile = select("validation_file");
  const method = select("method");
  const epochs = number("n_epochs", { min: 1, max: 100, placeholder: "auto" });
  const batch = number("batch_size", { min: 1, max: 4096, placeholder: "auto" });
  const multiplier = number("learning_rate_multiplier", { min: 0, step: "any", placeholder: "auto" });
  const seqLength = number("max_seq_length", { min: 16, max: 131072, value: 512 });
  const warmup = number("warmup_ratio", { min: 0, max: 0.99, step: "any", value: 0 });
  const scheduler = h("select", { id: "lr_scheduler" }, h("option", { value: "cosine" }, "cosine"), h("option", { value: "linear" }, "linear"));
  const gpus = number("n_gpus", { min: 1, max: 64, value: 1 });
  const kernels = check("kernels", true);
  const checkpointing = check("gradient_checkpointing", false);
  const packing = check("packing", false);
  const lora = check("lora", false);
  const loraRank = number("lora_r", { min: 1, max: 1024, value: 16 });
  const suffix = h("input", { type: "text", id: "suffix", maxlength: 64, pattern: "[A-Za-z0-9_-]+" });
  const seed = number("seed", { min: 0 });

  const estimatePanel = h("div", { id: "estimate", class: "estimate", "aria-live": "polite" }, h("p", { class: "muted" }, "Choose a model and a training file."));
  const submit = h("button", { type: "submit", id: "create-job", disabled: true }, "Create job");
  const submitError = h("div", { id: "create-error" });
  const form = h("form", { id: "new-job", class: "new-job" },
    h("fieldset", {}, h("legend", {}, "What to train"),
      field("Model", model), field("Training file", trainingFile), field("Validation file", validationFile), field("Method", method)),
    h("fieldset", {}, h("legend", {}, "Hyperparameters"),
      field("Epochs", epochs), field("Batch size (sequences per step)", batch), field("Learning rate multiplier", multiplier),
      field("Max sequence length", seqLength), field("Warmup ratio", warmup), field("LR schedule", scheduler), field("GPUs", gpus),
      field("fusetune kernels", kernels), field("Gradient checkpointing", checkpointing), field("Packing", packing),
      field("LoRA", lora), field("LoRA rank", loraRank), field("Suffix", suffix), field("Seed", seed)),
    h("div", { class: "side" }, h("h2", {}, "Estimate"), estimatePanel, submit, submitError));
  replaceChildren(main, h("h1", {}, "New fine-tuning job"), form);

  const optionsFor = (control, items, empty) => {
    replaceChildren(control, empty ? h("option", { value: "" }, empty) : null, items.map(([value, label]) => h("option", { value }, label)));
  };
  const loaded = Promise.all([
    api("v1/models").then((list) => optionsFor(model, list.data.map((m) => [m.id, m.id]))),
    api("v1/files").then((list) => {
      const items = list.data.map((f) => [f.id, `${f.filename} (${f.id}, ${formatCount(f.example_count)} examples)`]);
      optionsFor(trainingFile, items);
      optionsFor(validationFile, items, "none");
    }),
    methodTypes().then((types) => optionsFor(method, types.map((t) => [t, t]))),
  ]).catch((error) => replaceChildren(estimatePanel, errorBox(error.message)));

  const numberOrAuto = (input) => (input.value === "" ? "auto" : Number(input.value));
  function body() {
    const hyperparameters = {
      n_epochs: numberOrAuto(epochs),
      batch_size: numberOrAuto(batch),
      learning_rate_multiplier: numberOrAuto(multiplier),
      max_seq_length: Number(seqLength.value),
      warmup_ratio: Number(warmup.value),
      lr_scheduler: scheduler.value,
      n_gpus: Number(gpus.value),
      kernels: kernels.checked,
      gradient_checkpointing: checkpointing.checked,
      packing: packing.checked,
    };
    if (lora.checked) hyperparameters.lora = { r: Number(loraRank.value) };
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
      row("Peak memory per GPU", formatBytes(e.peak_memory_bytes_per_gpu), "estimate-memory"),
      Object.entries(e.memory_breakdown || {}).map(([part, bytes]) => row(part.replaceAll("_", " "), formatBytes(bytes), null, true)),
      row("GPU memory", e.gpu_memory_bytes ? formatBytes(e.gpu_memory_bytes) : "not set"),
      row("Fits", fits, "estimate-fits"),
      row("Time", e.duration_s !== null ? formatDuration(e.duration_s) : "unknown until this server has trained the model", "estimate-duration"),
      row("Throughput", e.tokens_per_second ? `${formatCount(Math.round(e.tokens_per_second))} tokens/s (${e.throughput_source})` : e.throughput_source)));
  }

  let requestedFor = null; // the body of the latest estimate asked for
  const scheduleEstimate = () => {
    // A blur fires "change" with nothing changed (as when the Create button is clicked): keep the estimate.
    const text = JSON.stringify(body());
    if (text === requestedFor) return;
    requestedFor = text;
    submit.disabled = true;
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

/** The training methods this server accepts, from its OpenAPI schema (the Method object's `type`). */
async function methodTypes() {
  try {
    const response = await fetch(new URL("../openapi.json", window.location.href), { cache: "no-store" });
    const type = (await response.json()).components.schemas.Method.properties.type;
    const values = type.enum || (type.const !== undefined ? [type.const] : null);
    if (values && values.length) return values;
  } catch {
    // fall through to the one method every server has
  }
  return ["supervised"];
}

function randomKey() {
  const bytes = crypto.getRandomValues(new Uint8Array(16));
  return `ui-${Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("")}`;
}
