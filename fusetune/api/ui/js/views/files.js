// Files page: the tenant's training files with example counts, token estimates and the result of the check
// every upload gets (a refused upload shows the server's list of bad lines).

import { api } from "../api.js";
import { errorBox, formatBytes, formatCount, formatTime, h, replaceChildren } from "../dom.js";

export function render(main) {
  const body = h("tbody");
  const status = h("div", { id: "files-status" });
  const input = h("input", { type: "file", id: "upload-file", accept: ".jsonl", required: true });
  const uploadResult = h("div", { id: "upload-result" });
  const submit = h("button", { type: "submit" }, "Upload and check");
  const form = h("form", { class: "toolbar", id: "upload-form" }, h("label", {}, "Training file (JSON Lines) ", input), submit);
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    if (!input.files.length) return;
    const data = new FormData();
    data.append("purpose", "fine-tune");
    data.append("file", input.files[0]);
    submit.disabled = true;
    replaceChildren(uploadResult, h("p", { class: "muted" }, "Uploading and checking every line…"));
    try {
      const file = await api("v1/files", { method: "POST", form: data });
      replaceChildren(uploadResult, h("p", { class: "ok" },
        `${file.filename} accepted: ${formatCount(file.example_count)} examples, about ${formatCount(file.token_estimate)} tokens.`));
      form.reset();
      load();
    } catch (error) {
      replaceChildren(uploadResult, errorBox(`Refused: ${error.message}`));
    } finally {
      submit.disabled = false;
    }
  });

  replaceChildren(
    main,
    h("h1", {}, "Files"),
    form,
    uploadResult,
    status,
    h("table", { class: "data", id: "files-table" },
      h("thead", {}, h("tr", {}, ["File", "Name", "Size", "Uploaded", "Examples", "Token estimate", "Validation"].map((c) => h("th", {}, c)))),
      body),
  );

  async function load() {
    try {
      const [list, options] = await Promise.all([api("v1/files"), api("v1/fine_tuning/options")]);
      replaceChildren(status, list.data.length ? null : h("p", { class: "muted" }, "No files yet."));
      replaceChildren(body, list.data.map((file) => h("tr", { dataset: { fileId: file.id } },
        h("td", {}, file.id),
        h("td", {}, file.filename),
        h("td", { class: "number" }, formatBytes(file.bytes)),
        h("td", {}, formatTime(file.created_at)),
        h("td", { class: "number" }, formatCount(file.example_count)),
        h("td", { class: "number" }, formatCount(file.token_estimate)),
        h("td", {}, validation(file, options)))));
    } catch (error) {
      replaceChildren(status, errorBox(error.message));
    }
  }

  load();
  return null;
}

// What every line of a training file is, by its line format (the options' `example_format` of its method).
const LINE_FORMATS = {
  supervised: "a supervised example (a chat, a prompt and completion, or a text)",
  preference: "a preference pair (an input with a preferred and a non-preferred output)",
  reinforcement: "a prompt with reference fields for the grader (reinforcement)",
};

// The server checks every line on upload and stores only files that pass, so a listed training file is a valid
// one; a job's results CSV (purpose fine-tune-results) is no training file.
function validation(file, options) {
  if (file.purpose === "fine-tune-results") return h("span", { class: "muted" }, "a job's results: one CSV row per step, not a training file");
  if (file.purpose !== "fine-tune") return h("span", { class: "muted" }, `purpose ${file.purpose}`);
  const format = options.methods[file.method]?.example_format;
  const what = LINE_FORMATS[format] || `a ${file.method} example`;
  if (file.status === "processed") return h("span", { class: "ok" }, `valid: every line is ${what}`);
  return h("span", { class: "warn" }, `${file.status}${file.status_details ? `: ${file.status_details}` : ""}`);
}
