// Line charts drawn as inline SVG: one per metric group, with a hover read-out.
// Input: data.series[key] = [[step, value or null], ...] (null: a non-finite value, drawn as a
// gap in the line and a red tick under the axis) and data.charts (see reroll/viewer/charts.py).

const CHART = { w: 560, h: 240, left: 58, right: 14, top: 10, bottom: 30 };

/** About `count` round numbers covering [lo, hi]. */
function niceTicks(lo, hi, count, integer) {
  const raw = (hi - lo) / Math.max(1, count);
  const mag = Math.pow(10, Math.floor(Math.log10(raw)));
  const norm = raw / mag;
  let step = (norm < 1.5 ? 1 : norm < 3 ? 2 : norm < 7 ? 5 : 10) * mag;
  if (integer) step = Math.max(1, Math.round(step));
  const ticks = [];
  for (let v = Math.ceil(lo / step - 1e-9) * step; v <= hi + step * 1e-9; v += step) {
    ticks.push(Number(v.toPrecision(12)));
  }
  return ticks;
}

/** A tick label with as many decimals as the tick spacing needs (ticks never print alike). */
function tickLabel(value, spacing) {
  if (value === 0) return "0";
  const a = Math.max(Math.abs(value), spacing);
  if (a >= 1e6 || spacing < 1e-4) return value.toExponential(Math.max(0, Math.ceil(Math.log10(a / spacing) - 1e-9)));
  return value.toFixed(Math.max(0, -Math.floor(Math.log10(spacing) + 1e-9)));
}

/** The smallest and largest of many numbers (no argument spreading: runs can be long). */
function minMax(values) {
  let lo = Infinity, hi = -Infinity;
  for (const v of values) { if (v < lo) lo = v; if (v > hi) hi = v; }
  return [lo, hi];
}

/** [lo, hi] around the values, padded, never empty. */
function extent(values) {
  let [lo, hi] = minMax(values);
  if (lo === hi) {
    const pad = Math.abs(lo) * 0.1 || 1;
    return [lo - pad, hi + pad];
  }
  const pad = (hi - lo) * 0.06;
  return [lo - pad, hi + pad];
}

function bandPoints(chart) {
  if (!chart.band) return [];
  const std = new Map((data.series[chart.band[1]] || []).map(([s, v]) => [s, v]));
  // Clipped to the step's lowest and highest value when the run logged them (bandRange).
  const range = chart.bandRange || [null, null];
  const lo = new Map((data.series[range[0]] || []).map(([s, v]) => [s, v]));
  const hi = new Map((data.series[range[1]] || []).map(([s, v]) => [s, v]));
  const clip = (m, s, v, pick) => (typeof m.get(s) === "number" ? pick(v, m.get(s)) : v);
  return (data.series[chart.band[0]] || [])
    .filter(([s, v]) => v !== null && typeof std.get(s) === "number")
    .map(([s, v]) => [s, clip(lo, s, v - std.get(s), Math.max), clip(hi, s, v + std.get(s), Math.min)]);
}

/** The SVG markup of one chart and the scales used, for the hover read-out. */
function chartSvg(chart) {
  const { w, h, left, right, top, bottom } = CHART;
  const pts = chart.keys.map((k) => (data.series[k] || []));
  const band = bandPoints(chart);
  const xs = pts.flat().map((p) => p[0]);
  const ys = pts.flat().filter((p) => p[1] !== null).map((p) => p[1])
    .concat(band.flatMap((b) => [b[1], b[2]]));
  if (!xs.length) return null;
  let [x0, x1] = minMax(xs);
  if (x0 === x1) { x0 -= 1; x1 += 1; }
  const [y0, y1] = ys.length ? extent(ys) : [0, 1];
  const sx = (s) => left + ((s - x0) / (x1 - x0)) * (w - left - right);
  const sy = (v) => top + (1 - (v - y0) / (y1 - y0)) * (h - top - bottom);
  const parts = [];
  const yTicks = niceTicks(y0, y1, 5, false);
  const spacing = yTicks.length > 1 ? yTicks[1] - yTicks[0] : Math.abs(y1 - y0);
  for (const t of yTicks) {
    parts.push(`<line class="grid" x1="${left}" x2="${w - right}" y1="${sy(t)}" y2="${sy(t)}"/>`,
      `<text x="${left - 6}" y="${sy(t) + 4}" text-anchor="end">${esc(tickLabel(t, spacing))}</text>`);
  }
  for (const t of niceTicks(x0, x1, 8, true)) {
    parts.push(`<line class="axis" x1="${sx(t)}" x2="${sx(t)}" y1="${h - bottom}" y2="${h - bottom + 4}"/>`,
      `<text x="${sx(t)}" y="${h - bottom + 16}" text-anchor="middle">${esc(fmt(t))}</text>`);
  }
  parts.push(`<line class="axis" x1="${left}" x2="${w - right}" y1="${h - bottom}" y2="${h - bottom}"/>`,
    `<text x="${w - right}" y="${h - 2}" text-anchor="end">step</text>`);
  if (band.length > 1) {
    const upper = band.map((b) => `${sx(b[0])},${sy(b[2])}`);
    const lower = band.slice().reverse().map((b) => `${sx(b[0])},${sy(b[1])}`);
    const color = PALETTE[chart.keys.indexOf(chart.band[0])] || PALETTE[0];
    parts.push(`<polygon class="band" fill="${color}" points="${upper.concat(lower).join(" ")}"/>`);
  }
  chart.keys.forEach((key, i) => {
    const color = PALETTE[i % PALETTE.length];
    const series = pts[i];
    const finite = series.filter((p) => p[1] !== null);
    let d = "", pen = "M";
    for (const [s, v] of series) {
      if (v === null) { pen = "M"; continue; }
      d += `${pen}${sx(s).toFixed(1)},${sy(v).toFixed(1)}`;
      pen = "L";
    }
    if (d) parts.push(`<path class="series" data-key="${esc(key)}" stroke="${color}" d="${d}"/>`);
    const sparse = key.startsWith("eval/") || finite.length <= 40;
    if (sparse) {
      for (const [s, v] of finite) {
        parts.push(`<circle class="point" data-key="${esc(key)}" cx="${sx(s)}" cy="${sy(v)}" r="3" fill="${color}"/>`);
      }
    }
    for (const [s, v] of series) {
      if (v === null) {
        parts.push(`<line class="nf" x1="${sx(s)}" x2="${sx(s)}" y1="${h - bottom - 6}" y2="${h - bottom}"><title>${esc(key)}: non-finite at step ${s}</title></line>`);
      }
    }
  });
  parts.push(`<line class="cursor" x1="0" x2="0" y1="${top}" y2="${h - bottom}" visibility="hidden"/>`,
    `<rect class="hover" x="${left}" y="${top}" width="${w - left - right}" height="${h - top - bottom}" fill="transparent"/>`);
  const svg = `<svg viewBox="0 0 ${w} ${h}" role="img" aria-label="${esc(chart.title)}">${parts.join("")}</svg>`;
  return { svg, sx, x0, x1 };
}

/** A chart card: title, legend with last values, the SVG, and notes. */
function renderChart(chart) {
  const card = el("div", "chart");
  card.id = "chart-" + chart.id;
  card.dataset.keys = chart.keys.join(" ");
  card.appendChild(el("h3", "", chart.title));
  const legend = el("div", "legend");
  chart.keys.forEach((key, i) => {
    const finite = (data.series[key] || []).filter((p) => p[1] !== null);
    const item = el("span");
    const swatch = el("span", "sw");
    swatch.style.background = PALETTE[i % PALETTE.length];
    item.append(swatch, key + " ");
    item.appendChild(el("span", "last", finite.length ? "last " + fmt(finite[finite.length - 1][1]) : "no values"));
    legend.appendChild(item);
  });
  card.appendChild(legend);
  const drawn = chartSvg(chart);
  const holder = el("div");
  if (drawn) holder.innerHTML = drawn.svg; else holder.appendChild(el("div", "empty", "no values"));
  card.appendChild(holder);
  if (chart.note) card.appendChild(el("div", "note", chart.note));
  for (const [key, steps] of Object.entries(chart.nonFinite || {})) {
    const shown = steps.slice(0, 12).join(", ") + (steps.length > 12 ? ", \u2026" : "");
    card.appendChild(el("div", "nonfinite", `${key}: non-finite (nan/inf) at step ${shown} \u2014 not drawn`));
  }
  if (drawn) attachHover(card, chart, drawn);
  return card;
}

/** A dashed cursor and a read-out of every series at the step nearest the mouse. */
function attachHover(card, chart, drawn) {
  const svg = card.querySelector("svg");
  const cursor = svg.querySelector(".cursor");
  const tip = el("div", "tip");
  card.appendChild(tip);
  const lookup = chart.keys.map((k) => new Map((data.series[k] || []).map(([s, v]) => [s, v])));
  const steps = [...new Set(chart.keys.flatMap((k) => (data.series[k] || []).map((p) => p[0])))].sort((a, b) => a - b);
  svg.querySelector(".hover").addEventListener("mousemove", (event) => {
    const box = svg.getBoundingClientRect();
    const x = ((event.clientX - box.left) / box.width) * CHART.w;
    let best = steps[0];
    for (const s of steps) if (Math.abs(drawn.sx(s) - x) < Math.abs(drawn.sx(best) - x)) best = s;
    cursor.setAttribute("x1", drawn.sx(best));
    cursor.setAttribute("x2", drawn.sx(best));
    cursor.setAttribute("visibility", "visible");
    const rows = chart.keys.map((k, i) => `<div><span style="color:${PALETTE[i % PALETTE.length]}">\u25CF</span> ${esc(k)}: <b>${esc(lookup[i].has(best) ? (lookup[i].get(best) === null ? "nan/inf" : fmt(lookup[i].get(best))) : "\u2014")}</b></div>`);
    tip.innerHTML = `<div><b>step ${esc(best)}</b></div>` + rows.join("");
    tip.style.display = "block";
    const holder = svg.parentElement;
    const px = (drawn.sx(best) / CHART.w) * box.width + holder.offsetLeft;
    tip.style.left = (px + tip.offsetWidth + 16 > card.clientWidth ? px - tip.offsetWidth - 10 : px + 10) + "px";
    tip.style.top = (holder.offsetTop + 8) + "px";
  });
  svg.querySelector(".hover").addEventListener("mouseleave", () => {
    cursor.setAttribute("visibility", "hidden");
    tip.style.display = "none";
  });
}

function renderCharts() {
  const main = document.getElementById("charts");
  const more = document.getElementById("more-charts");
  const fixed = document.getElementById("constant-charts");
  let extra = 0, constant = 0;
  for (const chart of data.charts) {
    if (chart.constant) { fixed.appendChild(renderChart(chart)); constant += 1; continue; }
    (chart.extra ? more : main).appendChild(renderChart(chart));
    if (chart.extra) extra += 1;
  }
  if (!data.charts.some((c) => !c.extra && !c.constant)) main.appendChild(el("div", "empty", "no metrics to draw"));
  document.getElementById("more-count").textContent = String(extra);
  if (!extra) document.getElementById("more").hidden = true;
  document.getElementById("constant-count").textContent = String(constant);
  if (!constant) document.getElementById("constant").hidden = true;
}
