// Small DOM and formatting helpers. Text from the server only ever becomes text nodes, never markup.

/** h("a", {href: "#/jobs", class: "x", onclick: fn}, "text", child, ...) */
export function h(tag, attributes = {}, ...children) {
  const element = document.createElement(tag);
  for (const [name, value] of Object.entries(attributes || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (name.startsWith("on") && typeof value === "function") element.addEventListener(name.slice(2), value);
    else if (name === "dataset") Object.assign(element.dataset, value);
    else if (value === true) element.setAttribute(name, "");
    else element.setAttribute(name, String(value));
  }
  append(element, children);
  return element;
}

function append(element, children) {
  for (const child of children.flat(Infinity)) {
    if (child === undefined || child === null || child === false) continue;
    element.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
}

export function replaceChildren(element, ...children) {
  element.replaceChildren();
  append(element, children);
}

export const FINISHED_STATUSES = new Set(["succeeded", "failed", "cancelled"]);
export const JOB_STATUSES = ["validating_files", "queued", "running", "paused", "succeeded", "failed", "cancelled"];

export const statusBadge = (status) => h("span", { class: `status status-${status}`, dataset: { status } }, status);

export function formatTime(seconds) {
  if (!seconds) return "—";
  return new Date(seconds * 1000).toLocaleString(undefined, { dateStyle: "short", timeStyle: "medium" });
}

export function formatDuration(seconds) {
  if (seconds === null || seconds === undefined || !Number.isFinite(seconds)) return "—";
  const s = Math.max(0, Math.round(seconds));
  if (s < 60) return `${s}s`;
  if (s < 3600) return `${Math.floor(s / 60)}m ${String(s % 60).padStart(2, "0")}s`;
  return `${Math.floor(s / 3600)}h ${String(Math.floor((s % 3600) / 60)).padStart(2, "0")}m`;
}

/** How long a job has trained: over all its attempts (the server's training_seconds), else from its start (or
 * creation) to its end, or to now while it runs. */
export function jobDuration(job) {
  if (job.training_seconds !== null && job.training_seconds !== undefined) return job.training_seconds;
  const start = job.started_at || job.created_at;
  if (!start) return null;
  if (job.finished_at) return job.finished_at - start;
  if (job.status === "running") return Date.now() / 1000 - start;
  return null;
}

const ATTEMPT_CAUSES = {
  handed_over: "handed over (worker stopped)",
  worker_lost: "worker lost",
  crashed: "crashed",
};

/** A job's attempts in a line: "1 paused · 2 worker lost (fault) · 3 running". */
export function formatAttempts(attempts) {
  if (!attempts || !attempts.length) return "—";
  return attempts
    .map((a) => `${a.number} ${a.cause ? ATTEMPT_CAUSES[a.cause] || a.cause : "running"}${a.fault ? " (fault)" : ""}`)
    .join(" · ");
}

export function formatCount(value) {
  if (value === null || value === undefined) return "—";
  return Number(value).toLocaleString("en-US");
}

export function formatBytes(bytes) {
  if (bytes === null || bytes === undefined || !Number.isFinite(bytes)) return "—";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let value = bytes;
  let unit = 0;
  while (Math.abs(value) >= 1024 && unit < units.length - 1) {
    value /= 1024;
    unit += 1;
  }
  return `${value.toFixed(unit === 0 ? 0 : 1)} ${units[unit]}`;
}

export function formatNumber(value, digits = 4) {
  if (value === null || value === undefined) return "—";
  if (typeof value !== "number") return String(value);
  if (Number.isInteger(value)) return formatCount(value);
  const magnitude = Math.abs(value);
  if (magnitude !== 0 && (magnitude < 1e-3 || magnitude >= 1e6)) return value.toExponential(2);
  return String(Number(value.toPrecision(digits))); // 0.003, not 0.003000
}

/** An error as a visible alert (role=alert, so it is announced and easy to find). */
export const errorBox = (message) => h("div", { class: "error", role: "alert" }, message);

/** The hash route's query, e.g. "#/jobs?status=running" -> URLSearchParams. */
export function hashQuery() {
  const hash = window.location.hash;
  const at = hash.indexOf("?");
  return new URLSearchParams(at < 0 ? "" : hash.slice(at + 1));
}

export function setHashQuery(path, params) {
  const query = new URLSearchParams();
  for (const [name, value] of Object.entries(params)) if (value) query.set(name, value);
  const text = query.toString();
  window.location.hash = text ? `${path}?${text}` : path;
}
