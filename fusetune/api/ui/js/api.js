// The /v1 API as the dashboard calls it: the key rides in the Authorization header of every request, never in a
// URL, and lives in this tab's sessionStorage only (gone when the tab closes).

const KEY_STORAGE = "fusetune.apiKey";
// The page is served at <root>/ui/; the API lives at <root>/v1/.
const API_ROOT = new URL("../", window.location.href);
export const METRICS_PAGE_SIZE = 1000;

export class ApiError extends Error {
  constructor(status, body, fallback) {
    const error = body && body.error;
    super(error && error.message ? error.message : `HTTP ${status}: ${fallback || "request failed"}`);
    this.status = status;
    this.code = error ? error.code : null;
    this.param = error ? error.param : null;
  }
}

export const getKey = () => window.sessionStorage.getItem(KEY_STORAGE);
export const setKey = (key) => window.sessionStorage.setItem(KEY_STORAGE, key);
export const clearKey = () => window.sessionStorage.removeItem(KEY_STORAGE);

let onUnauthorized = () => {};
/** Called with the ApiError when the server refuses the stored key (revoked, or the server's keys changed). */
export function setUnauthorizedHandler(handler) {
  onUnauthorized = handler;
}

export function apiUrl(path, query) {
  const url = new URL(path.replace(/^\//, ""), API_ROOT);
  for (const [name, value] of Object.entries(query || {})) {
    if (value !== undefined && value !== null && value !== "") url.searchParams.set(name, String(value));
  }
  return url;
}

async function errorFrom(response) {
  let body = null;
  try {
    body = await response.json();
  } catch {
    // not JSON: a proxy's error page, for example
  }
  return new ApiError(response.status, body, response.statusText);
}

/** One API call; resolves to the parsed JSON body or rejects with an ApiError carrying the server's message. */
export async function api(path, { method = "GET", query, json, form, key, headers } = {}) {
  const usedKey = key ?? getKey();
  const init = { method, headers: { Authorization: `Bearer ${usedKey}`, ...headers }, cache: "no-store" };
  if (json !== undefined) {
    init.headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(json);
  } else if (form !== undefined) {
    init.body = form;
  }
  const response = await fetch(apiUrl(path, query), init);
  if (!response.ok) {
    const error = await errorFrom(response);
    if (response.status === 401 && key === undefined) onUnauthorized(error);
    throw error;
  }
  return response.json();
}

const jobPath = (jobId) => `v1/fine_tuning/jobs/${encodeURIComponent(jobId)}`;

/** Every metrics point from `minStep` on, following the endpoint's pages (next page from last step + 1). */
export async function fetchMetricsFrom(jobId, minStep = 0, pageSize = METRICS_PAGE_SIZE) {
  const points = [];
  let next = minStep;
  for (;;) {
    const page = await api(`${jobPath(jobId)}/metrics`, { query: { min_step: next, limit: pageSize } });
    points.push(...page.data);
    if (!page.has_more || page.data.length === 0) return points;
    next = page.data[page.data.length - 1].step + 1;
  }
}

/** A job's metrics as they arrive: each `poll()` fetches only the steps after the last one it has. */
export class MetricsStream {
  constructor(jobId) {
    this.jobId = jobId;
    this.points = [];
  }

  get nextStep() {
    return this.points.length ? this.points[this.points.length - 1].step + 1 : 0;
  }

  async poll() {
    const fresh = await fetchMetricsFrom(this.jobId, this.nextStep);
    this.points.push(...fresh);
    return fresh.length;
  }
}

export const jobs = {
  list: (query) => api("v1/fine_tuning/jobs", { query }),
  get: (jobId) => api(jobPath(jobId)),
  action: (jobId, verb) => api(`${jobPath(jobId)}/${verb}`, { method: "POST" }),
  events: (jobId, query) => api(`${jobPath(jobId)}/events`, { query }),
  // Every checkpoint a job keeps fits one page of the most the route gives (the API's default page is 10).
  checkpoints: (jobId) => api(`${jobPath(jobId)}/checkpoints`, { query: { limit: 1000 } }),
  // The eval runs of the job's fine-tuned model (fusetune's route beside OpenAI's /v1/evals).
  evalRuns: (jobId) => api(`${jobPath(jobId)}/eval_runs`),
  create: (body, idempotencyKey) =>
    api("v1/fine_tuning/jobs", { method: "POST", json: body, headers: { "Idempotency-Key": idempotencyKey } }),
};

/**
 * Downloads a checkpoint archive through fetch (so the key stays in the header) into a Blob, then saves it
 * under the server's file name. The browser holds the archive in memory until it is saved.
 */
export async function downloadCheckpoint(jobId, checkpointId, { includeTrainingState = false, onProgress } = {}) {
  const url = apiUrl(`${jobPath(jobId)}/checkpoints/${encodeURIComponent(checkpointId)}/content`, {
    include_training_state: includeTrainingState ? "true" : null,
  });
  const response = await fetch(url, { headers: { Authorization: `Bearer ${getKey()}` }, cache: "no-store" });
  if (!response.ok) {
    const error = await errorFrom(response);
    if (response.status === 401) onUnauthorized(error);
    throw error;
  }
  const total = Number(response.headers.get("Content-Length")) || null;
  const reader = response.body.getReader();
  const chunks = [];
  let received = 0;
  for (;;) {
    const { done, value } = await reader.read();
    if (done) break;
    chunks.push(value);
    received += value.length;
    if (onProgress) onProgress(received, total);
  }
  const disposition = response.headers.get("Content-Disposition") || "";
  const match = /filename="?([^";]+)"?/.exec(disposition);
  const filename = match ? match[1] : `${jobId}-${checkpointId}.tar`;
  const blobUrl = URL.createObjectURL(new Blob(chunks, { type: "application/x-tar" }));
  const link = document.createElement("a");
  link.href = blobUrl;
  link.download = filename;
  document.body.append(link);
  link.click();
  link.remove();
  // The save has started by now; the URL is released after it had time to finish reading.
  setTimeout(() => URL.revokeObjectURL(blobUrl), 60_000);
  return { filename, bytes: received };
}
