// Per-step line charts on uPlot (vendored under ../vendor/uplot). One x value per reported step.

/* global uPlot */

export const PALETTE = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#be185d", "#65a30d"];

/**
 * A chart of one or more series against the step. `series`: [{label, color, dash, points}]; `format` formats
 * the y values on the axis and in the legend.
 */
export class StepChart {
  constructor(container, { title, series, format = (v) => v, name }) {
    this.container = container;
    this.series = series;
    this.format = format;
    this.element = document.createElement("div");
    this.element.className = "chart";
    if (name) this.element.dataset.chart = name;
    this.element.dataset.points = "0";
    container.append(this.element);
    this.data = [[], ...series.map(() => [])];
    const formatValue = (u, value) => (value === null || value === undefined ? "—" : format(value));
    this.plot = new uPlot(
      {
        title,
        width: this._width(),
        height: 220,
        scales: { x: { time: false } },
        axes: [
          { label: "step", stroke: "#475569", grid: { stroke: "#e2e8f0" } },
          { stroke: "#475569", grid: { stroke: "#e2e8f0" }, size: 70, values: (u, ticks) => ticks.map((t) => format(t)) },
        ],
        series: [
          { label: "step" },
          ...series.map((s) => ({
            label: s.label,
            stroke: s.color,
            width: 1.5,
            dash: s.dash,
            spanGaps: true,
            points: { show: s.points ?? ((u) => u.data[0].length <= 60), size: 5, fill: s.color },
            value: formatValue,
          })),
        ],
      },
      this.data,
      this.element,
    );
    // Tests and scripts read the plotted data from the element.
    this.element.uplot = this.plot;
    this._resize = new ResizeObserver(() => this.plot.setSize({ width: this._width(), height: 220 }));
    this._resize.observe(container);
  }

  _width() {
    return Math.max(280, Math.floor(this.container.clientWidth || 600) - 8);
  }

  /** `steps`: the x values; `columns`: one array per series, aligned with `steps` (null where missing). */
  setData(steps, columns) {
    this.data = [steps, ...columns];
    this.plot.setData(this.data);
    this.element.dataset.points = String(steps.length);
  }

  destroy() {
    this._resize.disconnect();
    this.plot.destroy();
    this.element.remove();
  }
}

/** Aligns several jobs' (steps, values) on one x axis: the union of their steps, null where a job has none. */
export function alignOnSteps(tables) {
  const steps = [...new Set(tables.flatMap((t) => t.steps))].sort((a, b) => a - b);
  const index = new Map(steps.map((step, i) => [step, i]));
  const columns = tables.map((t) => {
    const column = new Array(steps.length).fill(null);
    t.steps.forEach((step, i) => {
      column[index.get(step)] = t.values[i];
    });
    return column;
  });
  return { steps, columns };
}

/** Validation metrics come on evaluation steps only: their series are drawn as points. */
export const isValidation = (name) => name.startsWith("valid_");

export const valueOf = (point, name) => {
  if (name === "train_loss" && point.train_loss !== null && point.train_loss !== undefined) return point.train_loss;
  const value = point.values ? point.values[name] : undefined;
  return typeof value === "number" ? value : null;
};

/** The charts of the job page and the compare view: which metric, how it is shown. */
export const METRIC_CHARTS = [
  { name: "loss", title: "Loss", metrics: [["train_loss", "train"], ["valid_loss", "validation"]], format: (v) => v.toFixed(3) },
  // Supervised jobs report token accuracy, preference jobs reward accuracy; the validation series are the whole
  // validation file at each evaluation (epoch ends, checkpoints, eval_every_steps).
  {
    name: "accuracy",
    title: "Accuracy",
    metrics: [
      ["train_mean_token_accuracy", "train tokens"], ["valid_mean_token_accuracy", "validation tokens"],
      ["reward_accuracy", "train rewards"], ["valid_reward_accuracy", "validation rewards"],
    ],
    format: (v) => `${(v * 100).toFixed(1)}%`,
  },
  { name: "throughput", title: "Tokens / s", metrics: [["tokens_per_second", "tokens/s"]], format: (v) => compact(v) },
  { name: "mfu", title: "MFU (model FLOPs utilisation)", metrics: [["mfu", "MFU"]], format: (v) => `${(v * 100).toFixed(1)}%` },
  {
    name: "memory",
    title: "Peak memory",
    metrics: [["peak_memory_allocated_bytes", "allocated"], ["peak_memory_reserved_bytes", "reserved"]],
    // MiB below 4 GiB: a small model's peaks differ by a few MiB, which GiB with two decimals would hide.
    format: (v) => (Math.abs(v) < 4 * 2 ** 30 ? `${(v / 2 ** 20).toFixed(0)} MiB` : `${(v / 2 ** 30).toFixed(2)} GiB`),
  },
];

function compact(value) {
  if (Math.abs(value) >= 1e6) return `${(value / 1e6).toFixed(2)}M`;
  if (Math.abs(value) >= 1e3) return `${(value / 1e3).toFixed(1)}k`;
  return value.toFixed(0);
}
