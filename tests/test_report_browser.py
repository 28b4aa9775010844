"""The HTML report as it is drawn: the charts' text clear of their bars, the
stages named for the number of micro-batches, each parameter row linked to
its pictures; and the report opened in a real browser (Debian's
``chromium``, headless) where one is installed."""

from __future__ import annotations

import dataclasses
import html.parser
import json
import re
import shutil
import struct
import subprocess
import zlib

import jax
import numpy as np
import pytest

import autopar
from autopar.plan import CollectivePlan
from autopar.tools.groups import collapse, param_rows
from autopar.text import canonical_str
from models import mlp_setup

P = jax.sharding.PartitionSpec
# A monospace glyph is 0.6 em wide (DejaVu Sans Mono: 0.602): a label of n
# characters at font size f is taken to be 0.62 * f * n wide.
GLYPH_EM = 0.62


def _plan(num_micro_batches: int) -> autopar.Plan:
  """An MLP on a 2 x 4 mesh, its kernels pinned Megatron-style, so that the
  pass has an all-reduce over "model" and the gradients one over "data"."""
  make_state, step, batch = mlp_setup(batch=64, din=64, hidden=256, dout=64)
  mesh = jax.make_mesh((2, 4), ("data", "model"))
  kernel = "state.params['params']['Dense_%d']['kernel']"
  option = autopar.AutoShardingOption(
      force_batch_dim_to_mesh_dim="data", memory_budget_per_device=1 << 20,
      pins={kernel % 0: P(None, "model"), kernel % 1: P("model", None)})
  method = autopar.ShardParallel(mesh=mesh, option=option,
                                 num_micro_batches=num_micro_batches)
  return autopar.parallelize(step, method=method).plan(jax.eval_shape(make_state), batch)


@pytest.fixture(scope="module")
def plans():
  return {n: _plan(n) for n in (1, 2)}


class _Report(html.parser.HTMLParser):
  """What the checks read from the report: each bar chart's texts and bars,
  each parameter row's links, and the pictures by id."""

  def __init__(self, text: str):
    super().__init__()
    self.charts: list[dict] = []       # {"width", "font", "texts": [(x, y, s)], "rects"}
    self.row_links: dict[str, list[str]] = {}
    self.ids: set[str] = set()
    self.picture_spec: dict[str, str] = {}
    self._chart = self._text = self._row = self._pic = self._code = None
    self.feed(text)
    self.close()

  def handle_starttag(self, tag, attrs):
    a = dict(attrs)
    if "id" in a:
      assert a["id"] not in self.ids, f"id {a['id']!r} used twice"
      self.ids.add(a["id"])
    if tag == "svg" and "bars" in a.get("class", "").split():
      self._chart = {"width": float(a["width"]), "font": float(a["font-size"]),
                     "texts": [], "rects": []}
      self.charts.append(self._chart)
    elif tag == "text" and self._chart is not None:
      self._text = [float(a["x"]), float(a["y"]), ""]
    elif tag == "rect" and self._chart is not None:
      self._chart["rects"].append(tuple(float(a[k]) for k in ("x", "y", "width", "height")))
    elif tag == "tr":
      self._row = a.get("id")
      if self._row and self._row.startswith("param-"):
        self.row_links[self._row] = []
    elif tag == "a" and self._row in self.row_links:
      self.row_links[self._row].append(a.get("href", ""))
    elif tag == "div" and a.get("class") == "pic":
      self._pic = a["id"]
    elif tag == "code" and self._pic is not None:
      self._code = ""

  def handle_endtag(self, tag):
    if tag == "svg":
      self._chart = None
    elif tag == "text" and self._text is not None:
      self._chart["texts"].append(tuple(self._text))
      self._text = None
    elif tag == "tr":
      self._row = None
    elif tag == "code" and self._code is not None:
      self.picture_spec.setdefault(self._pic, self._code)
      self._code = None
    elif tag == "div":
      self._pic = None

  def handle_data(self, data):
    if self._text is not None:
      self._text[2] += data
    if self._code is not None:
      self._code += data


def _overlaps(chart: dict) -> list[str]:
  """Each text of the chart whose box (measured generously) meets a bar or
  runs past the chart's right edge."""
  f = chart["font"]
  bad = []
  for x, y, s in chart["texts"]:
    x1, top, bottom = x + GLYPH_EM * f * len(s), y - f, y + 0.25 * f
    for rx, ry, rw, rh in chart["rects"]:
      if x < rx + rw and rx < x1 and top < ry + rh and ry < bottom:
        bad.append(f"{s!r} (x {x:.0f}..{x1:.0f}) runs over the bar at x "
                   f"{rx:.0f}..{rx + rw:.0f}")
    if x1 > chart["width"]:
      bad.append(f"{s!r} ends at x {x1:.0f}, past the chart's width {chart['width']:.0f}")
  return bad


def _with_long_collective(plan: autopar.Plan) -> autopar.Plan:
  """The plan with one more collective: a long stage name and terabytes."""
  big = CollectivePlan(stage="accumulate_grad (each micro-batch) of a long-named stage",
                       kind="all-gather", axes=("data", "model"), bytes=3 << 40,
                       per_step=64, what="activations / partial sums")
  return dataclasses.replace(plan, collectives=plan.collectives + (big,))


@pytest.mark.parametrize("n", [1, 2])
def test_chart_text_clear_of_the_bars(plans, n):
  for plan in (plans[n], _with_long_collective(plans[n])):
    report = _Report(plan.to_html())
    assert len(report.charts) == 2            # the collectives and memory per device
    collectives, memory = report.charts
    assert len(collectives["rects"]) == len(plan.collectives) >= 2
    assert any(s.startswith("budget ") for _, _, s in memory["texts"])
    for chart in report.charts:
      bad = _overlaps(chart)
      assert not bad, bad


def test_one_micro_batch_is_not_each_micro_batch(plans):
  one, two = plans[1].to_html(), plans[2].to_html()
  assert "each micro-batch" not in one
  # The pass's all-reduce is in the one gradient stage that runs.
  labels = [s for _, _, s in _Report(one).charts[0]["texts"]]
  assert any(re.fullmatch(r"compute_grad_sync\b.* all-reduce \(model\)", s)
             for s in labels), labels
  assert "1 micro-batch," in one
  assert "accumulate_grad (each micro-batch) all-reduce (model)" in two
  assert "2 micro-batches," in two


def test_each_parameter_row_links_to_its_pictures(plans):
  plan = plans[2]
  report = _Report(plan.to_html())
  groups = collapse(param_rows(plan))
  assert len(report.row_links) == len(groups) >= 4     # two kernels, two biases
  for k, g in enumerate(groups):
    links = report.row_links[f"param-{k}"]
    assert links, f"row {g.name} links to no picture"
    for href in links:
      assert href.startswith("#") and href[1:] in report.picture_spec, (g.name, href)
    # The first link is the picture of the parameter's own spec.
    assert report.picture_spec[links[0][1:]] == canonical_str(g.first.value.spec), g.name


# The browser.

def _chromium() -> str:
  for name in ("chromium", "chromium-browser"):
    if path := shutil.which(name):
      return path
  pytest.skip("chromium is not installed: apt install chromium to run the browser check")


def _run_chromium(binary: str, tmp_path, *args: str) -> subprocess.CompletedProcess:
  profile = tmp_path / "profile"
  cmd = [binary, "--headless", "--disable-gpu", "--no-sandbox", "--no-first-run",
         "--disable-dev-shm-usage", "--hide-scrollbars", f"--user-data-dir={profile}",
         *args]
  done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
  assert done.returncode == 0, f"{' '.join(cmd)}\n{done.stderr[-3000:]}"
  return done


def _png_pixels(path) -> np.ndarray:
  """An 8-bit, non-interlaced PNG (as Chromium writes one) as an
  (height, width, channels) array."""
  data = path.read_bytes()
  assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
  pos, idat, header = 8, b"", None
  while pos < len(data):
    length, kind = struct.unpack(">I4s", data[pos:pos + 8])
    if kind == b"IHDR":
      header = struct.unpack(">IIBBBBB", data[pos + 8:pos + 8 + length])
    elif kind == b"IDAT":
      idat += data[pos + 8:pos + 8 + length]
    pos += 12 + length
  w, h, depth, colour, _, _, interlace = header
  c = {0: 1, 2: 3, 4: 2, 6: 4}[colour]
  assert depth == 8 and interlace == 0, f"a PNG this test does not read: {header}"
  raw = np.frombuffer(zlib.decompress(idat), np.uint8).reshape(h, 1 + w * c)
  out = np.zeros((h, w * c), np.uint8)
  up = np.zeros(w * c, np.uint8)
  for r in range(h):
    kind, line = raw[r, 0], raw[r, 1:]
    if kind == 0:                                        # none
      out[r] = line
    elif kind == 1:                                      # sub: a running sum per channel
      out[r] = np.cumsum(line.reshape(w, c), axis=0, dtype=np.uint64).reshape(-1) % 256
    elif kind == 2:                                      # up
      out[r] = line + up
    else:                                                # average, Paeth: byte by byte
      row, u = bytearray(w * c), up.tolist()
      for i, x in enumerate(line.tolist()):
        a = row[i - c] if i >= c else 0
        b = u[i]
        if kind == 3:
          row[i] = (x + (a + b) // 2) & 255
          continue
        ul = u[i - c] if i >= c else 0
        pa, pb, pc = abs(b - ul), abs(a - ul), abs(a + b - 2 * ul)
        row[i] = (x + (a if pa <= pb and pa <= pc else b if pb <= pc else ul)) & 255
      out[r] = np.frombuffer(bytes(row), np.uint8)
    up = out[r]
  return out.reshape(h, w, c)


# Measured by the browser itself: each chart text's box against every bar,
# and against the chart's width. (The report has no script; this copy does.)
_PROBE = """<script>
const bad = [];
for (const svg of document.querySelectorAll("svg.bars")) {
  const bars = [...svg.querySelectorAll("rect")].map(r => r.getBBox());
  for (const t of svg.querySelectorAll("text")) {
    const b = t.getBBox();
    for (const r of bars)
      if (b.x < r.x + r.width && r.x < b.x + b.width &&
          b.y < r.y + r.height && r.y < b.y + b.height)
        bad.push(t.textContent + " runs over a bar");
    if (b.x + b.width > svg.width.baseVal.value) bad.push(t.textContent + " is cut off");
  }
}
const n = document.querySelectorAll("svg.bars text").length;
document.body.setAttribute("data-probe", JSON.stringify({texts: n, bad: bad}));
</script></body>"""


def test_report_in_a_browser(plans, tmp_path):
  chromium = _chromium()
  plan = _with_long_collective(plans[1])
  page = tmp_path / "plan.html"
  text = plan.to_html(str(page))

  shot = tmp_path / "plan.png"
  _run_chromium(chromium, tmp_path, f"--screenshot={shot}", "--window-size=1400,2000",
                page.as_uri())
  assert shot.exists() and shot.stat().st_size > 10_000, "no screenshot, or an empty one"
  pixels = _png_pixels(shot)[..., :3].astype(np.int32)
  assert pixels.shape[:2] == (2000, 1400), pixels.shape
  drawn = np.any(pixels < 250, axis=-1).mean()
  assert drawn > 0.01, f"only {drawn:.2%} of the screenshot is not white"
  bar = np.abs(pixels - np.array([0x80, 0xb1, 0xd3])).max(axis=-1) <= 3
  assert bar.sum() > 100, "the bars' colour is nowhere in the screenshot"

  probe = tmp_path / "probe.html"
  probe.write_text(text.replace("</body>", _PROBE))
  dom = _run_chromium(chromium, tmp_path, "--dump-dom", probe.as_uri()).stdout
  start = dom.index("data-probe=\"") + len("data-probe=\"")
  result = json.loads(html.unescape(dom[start:dom.index("\"", start)]))
  assert result["texts"] >= 2 * len(plan.collectives), result
  assert not result["bad"], result["bad"]


@pytest.fixture(scope="module")
def pipeline_plan():
  """A 4-layer MLP in two pipeline stages of 2 x 2 devices, the batch split
  over "data" in each."""
  make_state, step, batch = mlp_setup(batch=64, din=64, hidden=256, dout=64, layers=4)
  method = autopar.PipeshardParallel(mesh=jax.make_mesh((4, 2), ("data", "model")),
                                     num_micro_batches=4, num_stages=2)
  return autopar.parallelize(step, method=method).plan(jax.eval_shape(make_state), batch)


def test_pipeline_report_says_what_the_stages_do(pipeline_plan):
  plan = pipeline_plan
  text = plan.to_html()
  report = _Report(text)
  assert "batch split over (data) in every stage" in text
  # The stage table is a table (not preformatted text), a row per stage.
  assert "<pre>pipeline" not in text and text.count("from device ") == 2
  collectives, memory = report.charts
  labels = [s for _, _, s in collectives["texts"]]
  for s in range(2):
    assert f"stage {s} gradient sync all-reduce (data)" in labels, labels
  assert [s for _, _, s in memory["texts"] if s.startswith("stage")] == ["stage 0",
                                                                       "stage 1"]
  for chart in report.charts:
    assert not _overlaps(chart), _overlaps(chart)


_WIDTH_PROBE = """<script>
document.body.setAttribute("data-probe", JSON.stringify(
    {width: document.documentElement.scrollWidth}));
</script></body>"""


def test_pipeline_report_fits_the_page_in_a_browser(pipeline_plan, tmp_path):
  """At 1280 px nothing runs past the window's right edge (the stage table
  was preformatted text as wide as its longest parameter list)."""
  chromium = _chromium()
  probe = tmp_path / "probe.html"
  probe.write_text(pipeline_plan.to_html().replace("</body>", _WIDTH_PROBE))
  dom = _run_chromium(chromium, tmp_path, "--window-size=1280,1000", "--dump-dom",
                      probe.as_uri()).stdout
  start = dom.index("data-probe=\"") + len("data-probe=\"")
  result = json.loads(html.unescape(dom[start:dom.index("\"", start)]))
  assert result["width"] <= 1280, result
