// The dashboard's shell: asks for the API key once per tab, then routes "#/..." to a view.

import { ApiError, api, clearKey, getKey, setKey, setUnauthorizedHandler } from "./api.js";
import { errorBox, h, replaceChildren } from "./dom.js";
import * as compareView from "./views/compare.js";
import * as filesView from "./views/files.js";
import * as jobView from "./views/job.js";
import * as jobsView from "./views/jobs.js";
import * as newJobView from "./views/new_job.js";

const main = document.getElementById("view");
const nav = document.getElementById("nav");
const session = document.getElementById("session");
let cleanup = null;

const ROUTES = [
  [/^#\/jobs\/([^/?]+)/, jobView, "jobs"],
  [/^#\/jobs(\?|$)/, jobsView, "jobs"],
  [/^#\/compare(\?|$)/, compareView, "compare"],
  [/^#\/files(\?|$)/, filesView, "files"],
  [/^#\/new(\?|$)/, newJobView, "new"],
];

function stopView() {
  if (cleanup) cleanup();
  cleanup = null;
}

function route() {
  stopView();
  if (!getKey()) {
    showSignIn();
    return;
  }
  nav.hidden = false;
  session.hidden = false;
  const hash = window.location.hash || "#/jobs";
  for (const [pattern, view, tab] of ROUTES) {
    const match = pattern.exec(hash);
    if (!match) continue;
    for (const link of nav.querySelectorAll("a")) link.classList.toggle("active", link.dataset.view === tab);
    replaceChildren(main);
    cleanup = view.render(main, match.slice(1).map(decodeURIComponent)) || null;
    return;
  }
  window.location.hash = "#/jobs";
}

function showSignIn(message) {
  stopView();
  nav.hidden = true;
  session.hidden = true;
  const input = h("input", {
    type: "password",
    id: "api-key",
    name: "api-key",
    autocomplete: "off",
    placeholder: "sk-…",
    required: true,
    size: 48,
  });
  const status = h("div", { class: "sign-in-status" }, message ? errorBox(message) : null);
  const submit = h("button", { type: "submit" }, "Open dashboard");
  const form = h(
    "form",
    { class: "sign-in", id: "sign-in" },
    h("h1", {}, "fusetune dashboard"),
    h("label", { for: "api-key" }, "API key"),
    input,
    submit,
    h("p", { class: "muted" }, "The key is kept in this browser tab only (session storage) and sent in the Authorization header."),
    status,
  );
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    const key = input.value.trim();
    submit.disabled = true;
    replaceChildren(status, h("p", { class: "muted" }, "Checking the key…"));
    try {
      await api("v1/fine_tuning/jobs", { query: { limit: 1 }, key });
      setKey(key);
      route();
    } catch (error) {
      replaceChildren(status, errorBox(error instanceof ApiError ? error.message : `Cannot reach the server: ${error.message}`));
    } finally {
      submit.disabled = false;
    }
  });
  replaceChildren(main, form);
  input.focus();
}

setUnauthorizedHandler((error) => {
  clearKey();
  showSignIn(`${error.message} Enter a valid key.`);
});

document.getElementById("sign-out").addEventListener("click", () => {
  clearKey();
  showSignIn();
});
window.addEventListener("hashchange", route);
route();
