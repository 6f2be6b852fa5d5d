// Form fields built from the server's description of an option (GET /v1/fine_tuning/options): the control, its
// default, bounds and choices are the job specification's; only the wording is the page's.

import { h } from "./dom.js";

/** A labelled row of a form: the label on the left, the control on the right, the description as its tooltip. */
export const field = (label, control, description) =>
  h("label", { class: "field", title: description || undefined }, h("span", {}, label), control);

/** The page's wording for `key` where it has one, else the option's name in words ("loss_type" -> "Loss type"). */
export const labelFor = (labels, key, name) => labels[key] ?? `${name.charAt(0).toUpperCase()}${name.slice(1).replaceAll("_", " ")}`;

/**
 * The control that edits an option, or null for one a form cannot edit (a list: the server's default stands).
 * A boolean is a checkbox, and so is an object that may be null (lora), which turns its own fields on; strings
 * with choices are a select ("auto" first where the option takes it); numbers are number inputs whose bounds
 * are the option's (an integer's exclusive bound moved inwards by one; a float's left to the server to refuse,
 * with a message naming it). `describe(value)` may give a choice its {label, title}.
 */
export function controlFor(id, option, describe = () => ({})) {
  if (option.type === "boolean" || option.type === "object") {
    return h("input", { type: "checkbox", id, name: id, checked: option.type === "boolean" ? option.default === true : option.default !== null });
  }
  if (option.type === "string" && option.choices) {
    const values = option.auto && !option.choices.includes("auto") ? ["auto", ...option.choices] : option.choices;
    return h("select", { id, name: id }, values.map((value) => {
      const { label, title } = describe(value);
      return h("option", { value, title, selected: value === option.default }, label ?? value);
    }));
  }
  if (option.type === "integer" || option.type === "number") {
    const integer = option.type === "integer";
    const bound = (value, exclusive, inwards) => (value === null ? undefined : integer && exclusive ? value + inwards : value);
    return h("input", {
      type: "number",
      id,
      name: id,
      min: bound(option.minimum, option.exclusive_minimum, 1),
      max: bound(option.maximum, option.exclusive_maximum, -1),
      step: integer ? 1 : "any",
      value: typeof option.default === "number" ? option.default : undefined,
      placeholder: option.auto ? "auto" : undefined,
    });
  }
  return null;
}

/** The value a control holds as a request takes it; undefined leaves the field out (the server's default). */
export function valueOf(option, control) {
  if (control.type === "checkbox") return control.checked;
  if (control.tagName === "SELECT") return control.value;
  if (control.value === "") return option.auto ? "auto" : undefined;
  return Number(control.value);
}
