// The table of recorded rollouts, training and held-out (eval) samples together: filters (step,
// samples, text, reward range, finish reason), sorting by column, a detail view per row (click
// it) with the full texts and, for agentic trajectories, the conversation turn by turn with each
// turn's reward, and "follow this prompt" to see one prompt's samples at every step.

const PAGE = 100;
const table = { rows: [], sort: { key: "step", dir: 1 }, limit: PAGE, open: new Set(), follow: null };

function haystack(row) {
  const turns = (row.turns || []).map((t) => t.role + " " + t.text).join("\n");
  return [row.prompt, row.response, row.answer, row.finish_reason, JSON.stringify(row.reward_info),
    JSON.stringify(row.extra), turns].join("\n").toLowerCase();
}

function readFilters() {
  const number = (id) => {
    const text = document.getElementById(id).value.trim();
    return text === "" || isNaN(Number(text)) ? null : Number(text);
  };
  return {
    step: document.getElementById("f-step").value,
    split: document.getElementById("f-split").value,
    finish: document.getElementById("f-finish").value,
    terms: document.getElementById("f-text").value.toLowerCase().split(/\s+/).filter(Boolean),
    min: number("f-min"),
    max: number("f-max"),
  };
}

/** Whether a row passes the filters: every search word must occur somewhere in the row. */
function passes(row, f) {
  if (table.follow !== null && row.prompt !== table.follow) return false;
  if (f.step !== "all" && String(row.step) !== f.step) return false;
  if (f.split !== "all" && row.split !== f.split) return false;
  if (f.finish !== "all" && row.finish_reason !== f.finish) return false;
  if (f.min !== null && !(row.reward !== null && row.reward >= f.min)) return false;
  if (f.max !== null && !(row.reward !== null && row.reward <= f.max)) return false;
  return f.terms.every((t) => row.haystack.includes(t));
}

function compare(a, b) {
  const { key, dir } = table.sort;
  const va = a[key], vb = b[key];
  if (va === vb) return a.index - b.index;
  if (va === null || va === undefined) return 1;
  if (vb === null || vb === undefined) return -1;
  return (va < vb ? -1 : 1) * dir;
}

function textCell(text, extraNode) {
  const td = el("td", "text");
  const div = el("div");
  if (extraNode) div.appendChild(extraNode);
  div.appendChild(textNodes(text));
  td.appendChild(div);
  return td;
}

function rewardCell(row) {
  const td = el("td", "num reward", row.reward === null ? (row.reward_raw || "\u2014") : fmt(row.reward));
  if (row.reward !== null && row.reward > 0) td.classList.add("pos");
  if (row.reward !== null && row.reward < 0) td.classList.add("neg");
  if (row.reward === null && row.reward_raw) td.classList.add("neg");
  return td;
}

function finishBadge(reason) {
  const badge = el("span", "badge", reason || "\u2014");
  if (reason === "length") badge.classList.add("length");
  if (reason === "stop") badge.classList.add("stop");
  return badge;
}

function rowNode(row) {
  const tr = el("tr", "rollout-row");
  tr.dataset.index = row.index;
  tr.dataset.step = row.step;
  tr.dataset.split = row.split;
  const step = el("td", "num", String(row.step));
  if (row.split === "eval") step.appendChild(el("span", "badge eval", "eval"));
  tr.append(step, el("td", "num", row.group_id === null ? "" : String(row.group_id)), rewardCell(row));
  const finish = el("td");
  finish.appendChild(finishBadge(row.finish_reason));
  tr.appendChild(finish);
  const turns = row.turns ? el("span", "badge turns", row.num_turns + (row.num_turns === 1 ? " turn" : " turns") +
    (row.turn_rewards ? ": " + row.turn_rewards.map((r) => (r === null ? "\u2014" : fmt(r))).join(" \u00b7 ") : "")) : null;
  const response = row.response || (row.turns || []).filter((t) => t.role === "policy").map((t) => t.text).join("\n\u2026\n");
  tr.append(textCell(row.prompt), textCell(response, turns), textCell(row.answer),
    textCell(row.reward_info === null ? "" : JSON.stringify(row.reward_info)));
  if (table.open.has(row.index)) tr.classList.add("open");
  tr.addEventListener("click", () => {
    if (table.open.has(row.index)) table.open.delete(row.index); else table.open.add(row.index);
    renderRows();
  });
  return tr;
}

function block(title, text, full) {
  const box = el("div", full ? "full" : "");
  box.appendChild(el("h4", "", title));
  box.appendChild(el("pre")).appendChild(textNodes(text));
  return box;
}

/** The conversation of an agentic trajectory: policy turns highlighted against env turns, each
 * policy turn with the reward the environment gave it. */
function turnsView(turns, turnRewards) {
  const box = el("div", "full");
  box.appendChild(el("h4", "", `turns (${turns.length})`));
  const list = el("div", "turns");
  for (const turn of turns) {
    const kind = turn.role === "policy" ? "policy" : "env";
    const item = el("div", "turn turn-" + kind);
    item.dataset.role = turn.role;
    const numbered = turn.turn !== null && turn.turn !== undefined;
    let label = (turn.role || "?") + (numbered ? " \u00b7 turn " + turn.turn : "");
    const reward = kind === "policy" && numbered && turnRewards ? turnRewards[turn.turn] : undefined;
    if (reward !== undefined) label += " \u00b7 reward " + (reward === null ? "\u2014" : fmt(reward));
    const pre = el("pre");
    pre.appendChild(textNodes(turn.text));
    item.append(el("div", "role", label), pre);
    list.appendChild(item);
  }
  box.appendChild(list);
  return box;
}

/** The prompt's images (PNG data URIs; null: one that could not be read when the report was built). */
function imagesView(images) {
  const box = el("div", "full images");
  box.appendChild(el("h4", "", "images"));
  for (const src of images) {
    if (src === null) { box.appendChild(el("span", "missing", "(image not found)")); continue; }
    const img = document.createElement("img");
    img.src = src;
    img.alt = "prompt image";
    box.appendChild(img);
  }
  return box;
}

function detailNode(row) {
  const tr = el("tr", "rollout-detail");
  const td = el("td");
  td.colSpan = 8;
  const grid = el("div", "detail detail-grid");
  const follow = el("button", "follow", table.follow === null ? "Follow this prompt across steps" : "Stop following");
  follow.type = "button";
  follow.addEventListener("click", (event) => { event.stopPropagation(); followPrompt(table.follow === null ? row.prompt : null); });
  grid.appendChild(follow);
  if (row.images) grid.appendChild(imagesView(row.images));
  grid.appendChild(block("prompt", row.prompt, true));
  if (row.turns) grid.appendChild(turnsView(row.turns, row.turn_rewards));
  if (row.response || !row.turns) grid.appendChild(block("response", row.response, true));
  grid.appendChild(block("answer", row.answer));
  grid.appendChild(block("reward info", JSON.stringify(row.reward_info, null, 2)));
  if (row.extra && Object.keys(row.extra).length) grid.appendChild(block("other fields", JSON.stringify(row.extra, null, 2), true));
  td.appendChild(grid);
  tr.appendChild(td);
  return tr;
}

function renderRows() {
  const f = readFilters();
  const matching = table.rows.filter((row) => passes(row, f)).sort(compare);
  const body = document.getElementById("rollout-body");
  body.replaceChildren();
  for (const row of matching.slice(0, table.limit)) {
    body.appendChild(rowNode(row));
    if (table.open.has(row.index)) body.appendChild(detailNode(row));
  }
  const shown = Math.min(matching.length, table.limit);
  const count = document.getElementById("rollout-count");
  count.dataset.matching = matching.length;
  count.dataset.shown = shown;
  count.textContent = `${matching.length} of ${table.rows.length} rollouts match` +
    (shown < matching.length ? ` \u2014 showing the first ${shown}` : "") + ". Click a row for its full text.";
  const more = document.getElementById("more-rows");
  more.hidden = shown >= matching.length;
  for (const th of document.querySelectorAll("th.sortable")) {
    th.dataset.arrow = th.dataset.key === table.sort.key ? (table.sort.dir > 0 ? " \u25B2" : " \u25BC") : "";
    th.textContent = th.dataset.label + th.dataset.arrow;
  }
}

/** Show only the rows of one prompt (null: all), every step and both kinds of samples, by step. */
function followPrompt(prompt) {
  table.follow = prompt;
  table.limit = PAGE;
  if (prompt !== null) {
    document.getElementById("f-step").value = "all";
    document.getElementById("f-split").value = "all";
    table.sort = { key: "step", dir: 1 };
  }
  const banner = document.getElementById("following");
  banner.hidden = prompt === null;
  document.getElementById("following-prompt").textContent = prompt === null ? "" : visible(prompt);
  renderRows();
}

function fillSelect(id, values, label) {
  const select = document.getElementById(id);
  for (const [value, count] of values) {
    const option = el("option", "", `${label(value)} (${count})`);
    option.value = String(value);
    select.appendChild(option);
  }
}

function counts(values) {
  const map = new Map();
  for (const v of values) map.set(v, (map.get(v) || 0) + 1);
  return [...map.entries()];
}

function renderTable() {
  table.rows = data.rollouts.map((row, index) => ({ ...row, index, haystack: haystack(row) }));
  if (!table.rows.length) {
    document.getElementById("rollout-ui").hidden = true;
    document.getElementById("rollout-none").hidden = false;
    return;
  }
  fillSelect("f-step", counts(table.rows.map((r) => r.step)).sort((a, b) => a[0] - b[0]), (s) => "step " + s);
  fillSelect("f-finish", counts(table.rows.map((r) => r.finish_reason)), (r) => r || "(none)");
  const refilter = () => { table.limit = PAGE; renderRows(); };
  if (!table.rows.some((r) => r.split === "eval")) document.getElementById("f-split").closest("label").hidden = true;
  for (const id of ["f-step", "f-split", "f-finish"]) document.getElementById(id).addEventListener("change", refilter);
  document.getElementById("follow-clear").addEventListener("click", () => followPrompt(null));
  for (const id of ["f-text", "f-min", "f-max"]) document.getElementById(id).addEventListener("input", refilter);
  document.getElementById("f-clear").addEventListener("click", () => {
    for (const id of ["f-text", "f-min", "f-max"]) document.getElementById(id).value = "";
    for (const id of ["f-step", "f-split", "f-finish"]) document.getElementById(id).value = "all";
    followPrompt(null);
  });
  document.getElementById("more-rows").addEventListener("click", () => { table.limit += PAGE; renderRows(); });
  for (const th of document.querySelectorAll("th.sortable")) {
    th.dataset.label = th.textContent;
    th.addEventListener("click", () => {
      const key = th.dataset.key;
      table.sort = { key, dir: table.sort.key === key ? -table.sort.dir : (key === "reward" ? -1 : 1) };
      renderRows();
    });
  }
  renderRows();
}
