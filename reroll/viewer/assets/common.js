// Helpers shared by charts.js and table.js. The three files are joined, in the order
// common.js, charts.js, table.js, inside one function scope by reroll/viewer/report.py.

/** Text made safe to place inside HTML or SVG markup. */
function esc(value) {
  return String(value).replace(/[&<>"']/g, (c) => ({
    "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;",
  })[c]);
}

/** Control characters (other than newline and tab) shown as their Unicode pictures. */
function visible(text) {
  return String(text).replace(/[\u0000-\u0008\u000b-\u001f\u007f]/g,
    (c) => String.fromCharCode(c === "\u007f" ? 0x2421 : 0x2400 + c.charCodeAt(0)));
}

/** The special tokens the page marks: the tokenizer's (`data.specialTokens`) and any `<|...|>`. */
const SPECIAL = new RegExp([...((typeof data !== "undefined" && data.specialTokens) || [])]
  .sort((a, b) => b.length - a.length).map((t) => t.replace(/[.*+?^${}()|[\]\\]/g, "\\$&"))
  .concat(["<\\|[^|<>\\s]{1,60}\\|>"]).join("|"), "g");

/** `visible(text)` as DOM nodes, each special token a marked span (so `<|im_end|>` reads as a
 * token, not as text the model wrote). */
function textNodes(text) {
  const source = visible(text);
  const fragment = document.createDocumentFragment();
  let last = 0;
  for (const match of source.matchAll(SPECIAL)) {
    if (match.index > last) fragment.appendChild(document.createTextNode(source.slice(last, match.index)));
    const token = el("span", "special", match[0]);
    token.title = "special token";
    fragment.appendChild(token);
    last = match.index + match[0].length;
  }
  if (last < source.length) fragment.appendChild(document.createTextNode(source.slice(last)));
  return fragment;
}

/** A number to 4 significant figures; integers as they are; null as a dash. */
function fmt(value) {
  if (value === null || value === undefined) return "\u2014";
  if (typeof value !== "number") return String(value);
  if (!isFinite(value)) return String(value);
  if (Number.isInteger(value) && Math.abs(value) < 1e15) return String(value);
  const a = Math.abs(value);
  if (a !== 0 && (a < 1e-3 || a >= 1e6)) return value.toExponential(2);
  return String(Number(value.toPrecision(4)));
}

/** An element with a class and, optionally, text content. */
function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

const PALETTE = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#be185d", "#4d7c0f"];
