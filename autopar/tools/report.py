"""``plan.to_html(path)`` / ``autopar report``: one self-contained HTML file.

No network, no scripts: inline CSS and SVG only (click a parameter row to
open its details, a ``<details>`` element). It holds the summary's tables,
a picture of each distinct sharding (the mesh's devices as a grid, each
labelled with the block of the array it holds and coloured by it, for any
rank, as ``jax.debug.visualize_array_sharding`` draws one array), a bar
chart of the collectives per stage, memory per device against the budget,
and for a pipeline its stages on the mesh and its schedule as a timeline.
"""

from __future__ import annotations

import html
import itertools
import math
from typing import TYPE_CHECKING, Any, Sequence

from autopar.costs.schedule import bubble
from autopar.tools.groups import collapse, other_rows, param_rows, params_prefix
from autopar.tools.summary import (batch_split, collective_rows, group_rows, input_sizes,
                                   memory_by_kind, solver_lines, stage_lines, stage_rows,
                                   timeline)
from autopar.text import canonical_str, format_bytes, spec_str

if TYPE_CHECKING:
  from autopar.plan import Plan

__all__ = ["to_html", "sharding_svg"]

_COLOURS = ["#8dd3c7", "#ffffb3", "#bebada", "#fb8072", "#80b1d3", "#fdb462", "#b3de69",
            "#fccde5", "#d9d9d9", "#bc80bd", "#ccebc5", "#ffed6f"]
_CSS = """
body { font-family: sans-serif; margin: 2em; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; font-size: 13px; }
th, td { border: 1px solid #ccc; padding: 3px 8px; text-align: left; }
th { background: #f0f0f0; }
code { font-size: 12px; }
details > summary { cursor: pointer; }
.pics { display: flex; flex-wrap: wrap; gap: 1.5em; }
.pic { border: 1px solid #ddd; padding: 0.5em; }
svg text { font-size: 11px; font-family: monospace; }
"""
# A chart's text is laid out from its length: _CHAR_PX is wider than a glyph
# of an 11 px monospace font (0.6 em, 6.6 px), so a label measured with it
# ends before the bars begin whatever font the browser picks.
_FONT_PX = 11
_CHAR_PX = 7
_GAP_PX = 8


def _e(x) -> str:
  return html.escape(str(x))


class _Markup(str):
  """A table cell that is HTML already (``_table`` escapes every other)."""


def _table(rows: Sequence[Sequence[str]], extra=None, ids=None) -> str:
  """``extra[k]``: HTML in a full-width row under row ``k``; ``ids[k]``:
  row ``k``'s id."""
  head = "".join(f"<th>{_e(c)}</th>" for c in rows[0])
  body = []
  for k, r in enumerate(rows[1:]):
    cells = "".join(f"<td>{c if isinstance(c, _Markup) else _e(c)}</td>" for c in r)
    row_id = f" id='{_e(ids[k])}'" if ids is not None else ""
    body.append(f"<tr{row_id}>{cells}</tr>")
    if extra is not None and extra[k]:
      body.append(f"<tr><td colspan='{len(r)}'>{extra[k]}</td></tr>")
  return f"<table><tr>{head}</tr>{''.join(body)}</table>"


def sharding_svg(spec, rank: int, mesh_shape: Sequence[int],
                 mesh_names: Sequence[str]) -> str:
  """The mesh's devices as a grid (the first axis down, the others across),
  each labelled with the index of the block of a rank-``rank`` array it
  holds under ``spec`` and coloured by that block: devices of one colour
  hold the same data."""
  entries = (list(spec) + [None] * rank)[:rank]
  pos = {a: i for i, a in enumerate(mesh_names)}
  rows = mesh_shape[0] if len(mesh_shape) > 1 else 1
  cols = max(1, math.prod(mesh_shape) // rows)
  cell_w, cell_h = max(30, 14 + 9 * (3 * rank)), 26
  blocks: dict[tuple, int] = {}
  cells = []
  for flat, coord in enumerate(itertools.product(*[range(s) for s in mesh_shape])):
    index = []
    for entry in entries:
      axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
      if not axes:
        index.append("*")
        continue
      k = 0
      for a in axes:
        k = k * mesh_shape[pos[a]] + coord[pos[a]]
      index.append(str(k))
    label = ",".join(index) if index else "*"
    colour = _COLOURS[blocks.setdefault(tuple(index), len(blocks)) % len(_COLOURS)]
    r, c = divmod(flat, cols)
    x, y = c * cell_w, r * cell_h
    cells.append(f"<rect x='{x}' y='{y}' width='{cell_w - 2}' height='{cell_h - 2}' "
                 f"fill='{colour}' stroke='#555'/><text x='{x + 4}' y='{y + 17}'>"
                 f"{_e(label)}</text>")
  w, h = cols * cell_w, rows * cell_h
  return (f"<svg width='{w}' height='{h}' viewBox='0 0 {w} {h}' role='img'>"
          f"<title>{_e(spec_str(spec))} on rank {rank}</title>{''.join(cells)}</svg>")


def _text_px(text: str) -> float:
  """The width ``text`` may take in a chart, at most (see ``_CHAR_PX``)."""
  return len(text) * _CHAR_PX


def _bars(items: Sequence[tuple[str, float]], unit, width: int = 420,
          limit: float | None = None) -> str:
  """A horizontal bar chart: the names in a column of their own, as wide as
  the longest, then the bars, each with ``unit(value)`` after it in room
  kept for the longest; ``limit``: a red line (a budget)."""
  top = max([v for _, v in items] + [limit or 0.0, 1e-30])
  h = 22
  x0 = max([_text_px(name) for name, _ in items] + [0.0]) + _GAP_PX
  right = x0 + width + _GAP_PX + max([_text_px(unit(v)) for _, v in items] + [0.0])
  parts = []
  for k, (name, v) in enumerate(items):
    y = k * h
    w = max(1.0, width * v / top)
    parts.append(f"<text x='0' y='{y + 15}'>{_e(name)}</text>"
                 f"<rect x='{x0:.1f}' y='{y + 3}' width='{w:.1f}' height='{h - 6}' "
                 f"fill='#80b1d3'/>"
                 f"<text x='{x0 + w + _GAP_PX / 2:.1f}' y='{y + 15}'>{_e(unit(v))}</text>")
  if limit:
    x = x0 + width * limit / top
    label = f"budget {unit(limit)}"
    right = max(right, x + 3 + _text_px(label))
    parts.append(f"<line x1='{x:.1f}' y1='0' x2='{x:.1f}' y2='{len(items) * h}' "
                 f"stroke='red' stroke-width='2'/><text x='{x + 3:.1f}' "
                 f"y='{len(items) * h + 12}' fill='red'>{_e(label)}</text>")
  total_h = len(items) * h + (16 if limit else 0)
  return (f"<svg class='bars' width='{math.ceil(right)}' height='{total_h}' "
          f"font-size='{_FONT_PX}' font-family='monospace' role='img'>"
          f"{''.join(parts)}</svg>")


def _stages_svg(plan: "Plan") -> str:
  """Each device of the mesh coloured by the stage that runs on it."""
  shape = plan.mesh_shape
  rows = shape[0] if len(shape) > 1 else 1
  total = math.prod(shape)
  cols = total // rows
  owner: dict[int, list[int]] = {}     # (interleaved: several stages a device)
  for st in plan.stages:
    for d in range(st.submesh_offset, st.submesh_offset + math.prod(st.submesh_shape)):
      owner.setdefault(d, []).append(st.index)
  cells = []
  for d in range(total):
    r, c = divmod(d, cols)
    s = owner.get(d, [None])[0]
    colour = _COLOURS[s % len(_COLOURS)] if s is not None else "#fff"
    label = "-" if s is None else ",".join(f"s{k}" for k in owner[d])
    cells.append(f"<rect x='{c * 40}' y='{r * 26}' width='38' height='24' fill='{colour}' "
                 f"stroke='#555'/><text x='{c * 40 + 4}' y='{r * 26 + 16}'>{label}</text>")
  return (f"<svg width='{cols * 40}' height='{rows * 26}' role='img'>{''.join(cells)}"
          f"</svg>")


def _timeline_svg(plan: "Plan") -> str:
  """The schedule replayed on the plan's predicted stage times
  (``summary.timeline``), beside the bubble the schedule has in theory with
  every stage alike (``schedule.bubble``)."""
  v, n = plan.virtual_stages, plan.num_micro_batches
  D = len(plan.stages) // v                 # submeshes: one row each
  schedule = plan.schedule or "1f1b"
  _, tl = timeline(plan)
  span = tl.makespan or 1.0
  width, h = 800, 24
  parts = []
  for t in tl.start:
    x = 40 + width * tl.start[t] / span
    w = max(1.0, width * (tl.end[t] - tl.start[t]) / span - 1)
    y = tl.submesh[t.stage] * h
    colour = {"F": "#80b1d3", "B": "#fdb462", "W": "#b3de69"}[t.kind]
    label = f"{t.kind}{t.micro_batch}" + (f"@{t.stage}" if v > 1 else "")
    parts.append(f"<rect x='{x:.1f}' y='{y + 2}' width='{w:.1f}' "
                 f"height='{h - 4}' fill='{colour}' stroke='#555'/>"
                 f"<text x='{x + 2:.1f}' y='{y + 16}'>{label}</text>")
  for d in range(D):
    parts.append(f"<text x='0' y='{d * h + 16}'>{'s' if v == 1 else 'm'}{d}</text>")
  return (f"<svg width='{width + 60}' height='{D * h}' role='img'>{''.join(parts)}</svg>"
          f"<p>{_e(schedule)}: bubble on these times {tl.bubble:.1%}; with every stage "
          f"alike, in theory, {bubble(schedule, D, n, virtual_stages=v):.1%}</p>")


def _weighed_table(plan: "Plan") -> str:
  """What the stage search weighed under ``schedule="auto"`` and
  ``num_micro_batches="auto"``: each choice, its best plan's modelled step
  and why it was or was not kept ("" where neither was searched)."""
  rows = [(f"schedule {name}", t, why) for name, t, why in plan.schedule_search]
  rows += [(f"{k} micro-batch{'' if k == 1 else 'es'}", t, why)
           for k, t, why in plan.micro_batch_search]
  if not rows:
    return ""
  return ("<h3>What the stage search weighed</h3>" + _table(
      [("choice", "step (model)", "")] +
      [(what, "-" if t is None else _seconds(t), why) for what, t, why in rows]))


def to_html(plan: "Plan", *, title: str = "autopar plan") -> str:
  """The report as HTML text (see the module docstring)."""
  sizes = plan.axis_sizes
  names, shape = tuple(plan.mesh_axis_names), tuple(plan.mesh_shape)
  out = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{_e(title)}</title>"
         f"<style>{_CSS}</style></head><body><h1>{_e(title)}</h1>"]
  mesh = " x ".join(f"{n}={s}" for n, s in sizes.items())
  micro = plan.num_micro_batches
  out.append(f"<p>{_e(plan.method)} on mesh ({_e(mesh)}), {micro} "
             f"micro-batch{'' if micro == 1 else 'es'}, batch split "
             f"{_e(batch_split(plan))}; objective {plan.objective:.4g} s "
             "(estimated).</p>")
  if plan.stages:
    # The text's lines around its table (stage_lines): what a stage does,
    # and what the step time is made of.
    lines = stage_lines(plan)
    step_time = [line for line in lines if line.startswith("predicted step time")]
    out.append("<h2>Pipeline stages</h2>")
    out.append(f"<p>{_e(lines[0])}: {_e(' '.join(lines[1:3]))}</p>")
    out.append(_table(stage_rows(plan)))
    out.append("".join(f"<p>{_e(line)}</p>" for line in step_time))
    out.append("<h3>Stages on the mesh</h3>" + _stages_svg(plan))
    out.append(f"<h3>Schedule ({_e(plan.schedule)})</h3>" + _timeline_svg(plan))
  out.append(_weighed_table(plan))

  # One picture per distinct (spec, rank, mesh it is over).
  pictures: dict[tuple, str] = {}
  over = {name: tuple(s.values()) for name, s in input_sizes(plan).items()}
  specs: dict[tuple, Any] = {}

  def pic(v, holder=None) -> str:
    # ``holder``: the input whose (sub)mesh ``v`` lies on (a gradient: its
    # parameter's, in a pipeline its stage's submesh).
    key = (canonical_str(v.spec), len(v.shape), over.get((holder or v).name, shape))
    if key not in pictures:
      pictures[key] = f"sharding-{len(pictures)}"
      specs[key] = v.spec
    return pictures[key]

  rows_ = param_rows(plan)
  params, others = collapse(rows_), collapse(other_rows(plan, rows_))
  specs_of = {}
  for g in params + others:
    specs_of[g.name] = [pic(g.first.value)]
    if g.first.grad is not None:
      specs_of[g.name].append(pic(g.first.grad, g.first.value))
    specs_of[g.name] += [pic(s) for _, s in g.first.state]
  for title_, groups, is_param in (("Parameters", params, True),
                                   ("Other inputs", others, False)):
    if not groups:
      continue
    rows = group_rows(groups, plan, params=is_param,
                      prefix=params_prefix(rows_) if is_param else "")
    rows = [rows[0] + ("pictures",)] + [
        r + (_Markup(", ".join(f"<a href='#{p}'>{p}</a>"
                               for p in dict.fromkeys(specs_of[g.name]))),)
        for g, r in zip(groups, rows[1:], strict=True)]
    details = [_details(g, plan) for g in groups]
    ids = [f"{'param' if is_param else 'input'}-{k}" for k in range(len(groups))]
    out.append(f"<h2>{title_}</h2>" + _table(rows, details, ids))

  out.append("<h2>Shardings</h2><div class='pics'>")
  for key, pid in pictures.items():
    spec, rank, mesh_shape = key
    where = "" if mesh_shape == shape else f", on a {'x'.join(map(str, mesh_shape))} submesh"
    out.append(f"<div class='pic' id='{pid}'><b>{pid}</b>: <code>{_e(spec)}</code>, "
               f"rank {rank}{where}<br>"
               f"{sharding_svg(specs[key], rank, mesh_shape, names)}</div>")
  out.append("</div><p>Each cell is a device: with a mesh of two or more axes the "
             "first axis runs down and the others, flattened, across (mesh axes: "
             f"{_e(', '.join(f'{n}={s}' for n, s in sizes.items()))}); a one-axis mesh "
             "is one row. A cell is labelled with the index of the block it holds per "
             "array dimension (* : the whole dimension); one colour, one block.</p>")

  coll = collective_rows(plan)
  out.append("<h2>Collectives per step</h2>")
  if coll:
    stage = {r["stage"]: _stage_label(r["stage"], micro) for r in coll}
    out.append(_bars([(f"{stage[r['stage']]} {r['kind']} ({', '.join(r['axes'])})",
                       r["seconds"]) for r in coll], _seconds))
    out.append(_table([("stage", "kind", "axes", "count", "bytes/device", "seconds")] +
                      [(stage[r["stage"]], r["kind"], ", ".join(r["axes"]), str(r["count"]),
                        format_bytes(r["bytes"]), f"{r['seconds']:.3g}") for r in coll]))
  else:
    out.append("<p>none</p>")
  memory = memory_by_kind(plan, rows_)
  budget = (plan.costs or {}).get("memory_budget_per_device")
  out.append("<h2>Memory per device</h2>")
  out.append(_bars([(k, float(v)) for k, v in memory.items()], format_bytes,
                   limit=float(budget) if budget else None))
  if plan.solver is not None or plan.costs:
    out.append("<h2>Solver and costs</h2><pre>" + _e("\n".join(solver_lines(plan))) +
               "</pre>")
  out.append("</body></html>")
  return "".join(out)


_EACH_MICRO_BATCH = "accumulate_grad (each micro-batch)"


def _seconds(t: float) -> str:
  return f"{t * 1e3:.3g} ms" if t < 1 else f"{t:.3g} s"


def _stage_label(stage: str, num_micro_batches: int) -> str:
  """The stage a collective runs in, as the report shows it. The planner
  names the pass's own collectives "accumulate_grad (each micro-batch)";
  with one micro-batch the pass runs once, as ``compute_grad_sync`` (see
  ``plan.grad_stage_names``), and is named so."""
  if num_micro_batches == 1:
    return stage.replace(_EACH_MICRO_BATCH, "compute_grad_sync (once per step)")
  return stage


def _values(row):
  yield row.value
  if row.grad is not None:
    yield row.grad
  for _, s in row.state:
    yield s


def _details(group, plan: "Plan") -> str:
  """The group's leaves, each with its spec and bytes per device, in a
  ``<details>`` element (opened by a click)."""
  sizes = input_sizes(plan)
  items = []
  for r in group.rows:
    for v in _values(r):
      # A gradient lies where its parameter does (a pipeline stage's submesh).
      b = v.bytes_per_device(sizes.get(v.name, sizes.get(r.value.name, plan.axis_sizes)))
      items.append(f"<tr><td><code>{_e(v.name)}</code></td><td>{_e(spec_str(v.spec))}</td>"
                   f"<td>{_e(format_bytes(b))}</td></tr>")
  leaves = "1 leaf" if len(items) == 1 else f"{len(items)} leaves"
  return (f"<details><summary>{leaves}</summary><table><tr><th>leaf</th>"
          f"<th>spec</th><th>bytes/device</th></tr>{''.join(items)}</table></details>")
