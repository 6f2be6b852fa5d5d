// Jobs list: status, model, method, created, duration, trained tokens; filters by status and model; refreshed
// every 2 s so statuses change live; rows can be picked for the compare view.

import { api, jobs } from "../api.js";
import {
  JOB_STATUSES,
  errorBox,
  formatCount,
  formatDuration,
  formatTime,
  h,
  hashQuery,
  jobDuration,
  replaceChildren,
  setHashQuery,
  statusBadge,
} from "../dom.js";
import { poll } from "./poll.js";

const PAGE_SIZE = 100;
const REFRESH_MS = 2000;

export function render(main) {
  const query = hashQuery();
  const filters = { status: query.get("status") || "", model: query.get("model") || "" };
  const selected = new Set();
  let pages = 1;

  const statusSelect = h("select", { id: "filter-status", name: "status" }, h("option", { value: "" }, "any status"),
    JOB_STATUSES.map((s) => h("option", { value: s, selected: s === filters.status }, s)));
  const modelSelect = h("select", { id: "filter-model", name: "model" }, h("option", { value: "" }, "any model"));
  if (filters.model) modelSelect.append(h("option", { value: filters.model, selected: true }, filters.model));
  const applyFilters = () => setHashQuery("#/jobs", { status: statusSelect.value, model: modelSelect.value });
  statusSelect.addEventListener("change", applyFilters);
  modelSelect.addEventListener("change", applyFilters);

  const compareButton = h("button", { type: "button", id: "compare-selected", disabled: true }, "Compare selected");
  compareButton.addEventListener("click", () => {
    window.location.hash = `#/compare?jobs=${[...selected].map(encodeURIComponent).join(",")}`;
  });
  const status = h("div", { id: "jobs-status" });
  const body = h("tbody");
  const more = h("button", { type: "button", id: "jobs-more", hidden: true }, "Load more");
  more.addEventListener("click", () => {
    pages += 1;
    refresh();
  });

  replaceChildren(
    main,
    h("div", { class: "title-row" }, h("h1", {}, "Fine-tuning jobs"), h("a", { class: "button", href: "#/new" }, "New job")),
    h("div", { class: "toolbar" }, h("label", {}, "Status ", statusSelect), h("label", {}, "Model ", modelSelect), compareButton),
    status,
    h("table", { class: "data", id: "jobs-table" },
      h("thead", {}, h("tr", {}, h("th", {}, ""), ["Job", "Status", "Model", "Method", "Created", "Training time", "Trained tokens"].map((c) => h("th", {}, c)))),
      body),
    more,
  );

  // The model filter offers the server's models and any model a listed job uses.
  const knownModels = new Set(filters.model ? [filters.model] : []);
  const addModels = (names) => {
    for (const name of names) {
      if (knownModels.has(name)) continue;
      knownModels.add(name);
      modelSelect.append(h("option", { value: name }, name));
    }
  };
  api("v1/models").then((list) => addModels(list.data.map((m) => m.id)), () => {});

  const row = (job) => {
    const box = h("input", { type: "checkbox", "aria-label": `select ${job.id}`, checked: selected.has(job.id) });
    box.addEventListener("change", () => {
      if (box.checked) selected.add(job.id);
      else selected.delete(job.id);
      compareButton.disabled = selected.size < 2;
    });
    return h("tr", { dataset: { jobId: job.id, status: job.status } },
      h("td", {}, box),
      h("td", {}, h("a", { href: `#/jobs/${encodeURIComponent(job.id)}` }, job.id)),
      h("td", {}, statusBadge(job.status)),
      h("td", {}, job.model),
      h("td", {}, (job.method && job.method.type) || "supervised"),
      h("td", {}, formatTime(job.created_at)),
      h("td", {}, formatDuration(jobDuration(job))),
      h("td", { class: "number" }, formatCount(job.trained_tokens)));
  };

  async function refresh() {
    const listed = [];
    let after = null;
    let hasMore = false;
    try {
      for (let page = 0; page < pages; page += 1) {
        const result = await jobs.list({ limit: PAGE_SIZE, after, status: filters.status, model: filters.model });
        listed.push(...result.data);
        hasMore = result.has_more;
        if (!hasMore) break;
        after = result.data[result.data.length - 1].id;
      }
    } catch (error) {
      replaceChildren(body);
      replaceChildren(status, errorBox(error.message));
      return error.status !== 401;
    }
    addModels(listed.map((job) => job.model));
    replaceChildren(status, listed.length ? null : h("p", { class: "muted", id: "jobs-empty" }, "No jobs match."));
    replaceChildren(body, listed.map(row));
    more.hidden = !hasMore;
    return true;
  }

  return poll(refresh, REFRESH_MS);
}
