// report.html's figures, drawn from metrics.csv's rows embedded once (D.rows: one array per column), and its
// sortable tables. Nothing here computes a statistic: R² comes from stats.csv (D.r2).
"use strict";
const D = JSON.parse(document.getElementById("ncanalyze-data").textContent);
const R = D.rows, N = R.run.length, C = D.colours;
const CONFIG = {displaylogo: false, responsive: true};
const LEGEND = {itemclick: "toggleothers", itemdoubleclick: "toggle", orientation: "h", y: -0.18, yanchor: "top",
                title: {text: "runs (click one: it alone; again: all); the large ringed marker: a run's last step"}};
const $ = (id) => document.getElementById(id);
const finite = (v) => v !== null && Number.isFinite(v);
const text = (v) => (v === null || v === undefined ? "—" : String(v));
const count = (v) => (finite(v) ? Math.round(v).toLocaleString("en-US") : "—");

function picked() {
  return {metric: $("metric").value, layer: $("layer") ? $("layer").value : "last",
          tag: $("tag") ? $("tag").value : D.tags[0]};
}

// Indices of the picked tag's rows at the picked layer ("last": each checkpoint's last), or at every layer.
function rowsOf(p, everyLayer = false) {
  const out = [];
  for (let i = 0; i < N; i++) {
    if (R._tag[i] !== p.tag) continue;
    if (!everyLayer && (p.layer === "last" ? !R._last[i] : String(R.layer[i]) !== p.layer)) continue;
    out.push(i);
  }
  return out;
}

// Rows grouped by run, in the table's order of runs, each run's rows in step order.
function byRun(rows) {
  const runs = new Map();
  for (const i of rows) (runs.get(R.run[i]) || runs.set(R.run[i], []).get(R.run[i])).push(i);
  for (const g of runs.values()) g.sort((a, b) => (R.global_step ? R.global_step[a] - R.global_step[b] : 0));
  return runs;
}

// What a hover shows of a row: run, checkpoint, step, tag, parameters, kept classes, layer, the target. Names are
// the _shown_ columns: entities for & < >, so plotly draws them as text, never as its label markup (<a href>).
function custom(i) {
  return [R._shown_run[i], text(R.checkpoint && R._shown_checkpoint[i]),
          count(R.global_step ? R.global_step[i] : null), text(R.tag ? R._shown_tag[i] : null),
          count(R.n_params ? R.n_params[i] : null),
          count(R.n_kept ? R.n_kept[i] : null), R.layer ? text(R.layer[i]) : "", R[D.target][i]];
}

function hover(lines) {
  const head = ["<b>run %{customdata[0]}</b>", "checkpoint %{customdata[1]}", "step %{customdata[2]}",
                "tag %{customdata[3]}", "parameters %{customdata[4]}"];
  if (D.layers.length) head.push("layer %{customdata[6]}");
  return head.concat(lines, ["kept classes %{customdata[5]}"]).join("<br>") + "<extra></extra>";
}

// A run's markers: its own symbol (the PNG's marker), its last step larger and ringed (a trajectory's direction)
// where it has several checkpoints; coloured by size (a colour bar) where sizes differ, else by run.
function marker(rows, first) {
  const run = R.run[rows[0]], last = rows.length > 1 ? rows.length - 1 : -1;
  const shape = {symbol: C.symbol[run], size: rows.map((_, k) => (k === last ? 13 : 8)),
                 line: {color: "black", width: rows.map((_, k) => (k === last ? 2 : 0.5))}};
  if (!C.size_scale) return Object.assign(shape, {color: C.run[run]});
  const s = C.size_scale;
  return Object.assign(shape, {color: rows.map((i) => (R.n_params[i] > 0 ? Math.log10(R.n_params[i]) : null)),
          colorscale: "Viridis", cmin: s.cmin, cmax: s.cmax, showscale: first,
          colorbar: {title: {text: "parameters", side: "right"}, tickvals: s.tickvals, ticktext: s.ticktext}});
}

// A metric's jackknife error as the hover says it after the value (" ± 0.00123"), or nothing.
function seText(m, i) {
  const c = R[m + "_se"];
  return c && finite(c[i]) ? " ± " + Number(c[i]).toPrecision(3) : "";
}

// One trace per run: y against x (column names, or functions of a row), its checkpoints joined in step order; the
// hover's customdata[8] is metric se's error.
function runTraces(rows, x, y, lines, axes, legend, se) {
  const get = (f) => (typeof f === "function" ? f : (i) => R[f][i]);
  const traces = [];
  let first = true;
  for (const [run, g] of byRun(rows)) {
    traces.push({type: "scatter", mode: "lines+markers", name: R._shown_run[g[0]], legendgroup: run,
                 showlegend: legend,
                 x: g.map(get(x)), y: g.map(get(y)), customdata: g.map((i) => custom(i).concat([se ? seText(se, i) : ""])), hovertemplate: hover(lines),
                 xaxis: axes[0], yaxis: axes[1], line: {color: C.run[run], width: 1, dash: C.dash[run]},
                 marker: marker(g, first)});
    first = false;
  }
  return traces;
}

function logAxis(rows, column) {
  const v = rows.map((i) => R[column][i]).filter(finite);
  return v.length > 0 && v.every((x) => x > 0) ? "log" : "linear";
}

// The panel's R² with its scale, the permutation p with its unit and the runs x checkpoints (stats.csv's, as the
// PNG's legend says them).
function r2Text(p, m, scale) {
  const s = p.layer === "last" && D.r2[p.tag] && D.r2[p.tag][m] && D.r2[p.tag][m][scale];
  return s ? s.text : "R²: the statistics use the last layer";
}

const valueLines = (m) => [`${m} = %{x:.6g}%{customdata[8]}`, `${D.target} = %{y:.6g}`];

function layoutOf(title, extra) {
  return Object.assign({title: {text: title, font: {size: 14}}, hovermode: "closest", legend: LEGEND,
                        margin: {t: 80, r: 20, b: 40, l: 70}}, extra);
}

// Figure 1: a panel per metric, the target shared on y.
function drawFig1(p) {
  if (!D.fig1.length) return Promise.resolve();
  const rows = rowsOf(p), k = D.fig1.length, gap = 0.04, layout = {annotations: []};
  let traces = [];
  D.fig1.forEach((m, j) => {
    const ax = j === 0 ? "" : String(j + 1), type = logAxis(rows, m);
    traces = traces.concat(runTraces(rows, m, D.target, valueLines(m), ["x" + ax, "y"], j === 0, m));
    layout["xaxis" + ax] = {domain: [j / k + (j ? gap / 2 : 0), (j + 1) / k - (j < k - 1 ? gap / 2 : 0)], type,
                            title: {text: m + (type === "log" ? " (log scale)" : "")}, anchor: "y"};
    layout.annotations.push({text: `<b>${D.labels[m]}</b><br>${r2Text(p, m, type === "log" ? "log" : "raw")}`,
                             xref: "x" + ax + " domain", yref: "paper", x: 0.5, y: 1.0, yanchor: "bottom",
                             showarrow: false, font: {size: 11}});
  });
  layout.yaxis = {title: {text: D.labels[D.target]}};
  const title = `Figure 1: NC properties against ${D.labels[D.target]}` + (C.size_note ? ` (${C.size_note})` : "");
  return Plotly.react("fig1", traces, layoutOf(title, layout), CONFIG);
}

// The picked metric against the target, and against the step (a line per run).
function drawPicked(p) {
  const rows = rowsOf(p), m = p.metric, type = logAxis(rows, m);
  const scatter = Plotly.react("scatter", runTraces(rows, m, D.target, valueLines(m), ["x", "y"], true, m),
    layoutOf(`${D.labels[m]}<br><sub>${r2Text(p, m, type === "log" ? "log" : "raw")}</sub>`,
             {xaxis: {type, title: {text: m + (type === "log" ? " (log scale)" : "")}},
              yaxis: {title: {text: D.labels[D.target]}}}), CONFIG);
  if (!R.global_step) return scatter;
  const shift = rows.some((i) => R.global_step[i] === 0) ? 1 : 0;
  const lines = [`${m} = %{y:.6g}%{customdata[8]}`, `${D.target} = %{customdata[7]:.6g}`];
  const dynamics = Plotly.react("dynamics",
    runTraces(rows, (i) => (finite(R.global_step[i]) ? R.global_step[i] + shift : null), m, lines, ["x", "y"], true,
              m),
    layoutOf(`Training dynamics: ${D.labels[m]}`,
             {xaxis: {type: "log", title: {text: "global step" + (shift ? " + 1" : "") + " (log scale)"}},
              yaxis: {type, title: {text: m + (type === "log" ? " (log scale)" : "")}}}), CONFIG);
  return Promise.all([scatter, dynamics]);
}

// The picked metric against the layer: a trace per run (its symbol and dash; the legend picks runs), a line per
// checkpoint and site kind in it (a null between them; a block's attn/mlp sites at B + 0.5), the markers coloured by
// step.
function drawDepth(p) {
  if (!D.layers.length) return Promise.resolve();
  const m = p.metric, checkpoints = new Map();
  const kind = (i) => (R.site && R.site[i] ? String(R.site[i]).split(":")[0] : "resid");
  for (const i of rowsOf(p, true)) {
    const key = R.run[i] + "/" + R.checkpoint[i] + "/" + kind(i);
    (checkpoints.get(key) || checkpoints.set(key, []).get(key)).push(i);
  }
  const runs = new Map();
  for (const g of checkpoints.values()) {
    g.sort((a, b) => R.layer[a] - R.layer[b]);
    const run = R.run[g[0]];
    (runs.get(run) || runs.set(run, []).get(run)).push(...g, null);  // null: the line ends
  }
  const [lo, hi] = C.step_range, traces = [];
  for (const [run, g] of runs) {
    const rows = g.filter((i) => i !== null);
    traces.push({type: "scatter", mode: "lines+markers", name: R._shown_run[rows[0]], legendgroup: run,
                 x: g.map((i) => (i === null ? null : R.layer[i])), y: g.map((i) => (i === null ? null : R[m][i])),
                 customdata: g.map((i) => (i === null ? null : custom(i))), hovertemplate: hover([`${m} = %{y:.6g}`]),
                 line: {color: "#999999", width: 1, dash: C.dash[run]},
                 marker: {size: 7, symbol: C.symbol[run], line: {color: "black", width: 0.5},
                          color: g.map((i) => (i === null ? null : R.global_step[i])), colorscale: "Viridis",
                          cmin: lo, cmax: hi, showscale: traces.length === 0,
                          colorbar: {title: {text: "global step"}}}});
  }
  const layout = layoutOf(`${D.labels[m]} across depth (marker colour: the step)`, {
    xaxis: {title: {text: "layer (hidden_states index)"}, dtick: 1}, yaxis: {title: {text: m}},
    legend: Object.assign({}, LEGEND, {title: {text: "runs (click one: it alone; again: all)"}})});
  return Plotly.react("depth", traces, layout, CONFIG);
}

function draw() {
  const p = picked();
  return Promise.all([drawFig1(p), drawPicked(p), drawDepth(p)]);
}

// Sortable tables: a header click sorts by the exact values (data-v) where the cells have them, else the text.
function sortBy(th) {
  const table = th.closest("table"), col = th.cellIndex, asc = th.dataset.dir !== "asc";
  table.querySelectorAll("th").forEach((h) => delete h.dataset.dir);
  th.dataset.dir = asc ? "asc" : "desc";
  const key = (tr) => {
    const td = tr.cells[col];
    return td.dataset.v === undefined ? td.textContent : (td.dataset.v === "" ? null : Number(td.dataset.v));
  };
  const rows = Array.from(table.tBodies[0].rows);
  rows.sort((a, b) => {
    const x = key(a), y = key(b);
    if (x === null || y === null) return (x === null) - (y === null);  // missing values last, either way
    return (asc ? 1 : -1) * (typeof x === "number" ? x - y : x.localeCompare(y));
  });
  rows.forEach((tr) => table.tBodies[0].appendChild(tr));
}

document.querySelectorAll("table.sortable th").forEach((th) => th.addEventListener("click", () => sortBy(th)));
document.querySelectorAll("#pickers select").forEach((s) => s.addEventListener("change", () => {
  document.body.dataset.ready = "";
  draw().then(() => { document.body.dataset.ready = "1"; });
}));
if (D.fig1.length) $("metric").value = D.fig1[0];
const started = performance.now();  // the time the figures take to draw, for benchmarks/report.py
draw().then(() => {
  document.body.dataset.drawMs = Math.round(performance.now() - started);
  document.body.dataset.ready = "1";
});
