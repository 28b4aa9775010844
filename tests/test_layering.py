"""The compiler's stages import one way (docs/design.md, ``.importlinter``):
read from the import graph (grimp, which import-linter is built on; it
counts function-local imports too)."""

import grimp

import autopar

BELOW_PLAN = ("autopar.tools", "autopar.runtime", "autopar.api", "autopar.signature",
              "autopar.backend", "autopar.planner")


def _graph():
  return grimp.build_graph("autopar", cache_dir=None)


def test_the_plan_data_reaches_no_tool_and_no_runtime():
  """Nothing ``autopar.plan`` imports, directly or not, is a tool, the
  runtime, the facade, the back end or the planner: a plan is data."""
  graph = _graph()
  reached = graph.find_upstream_modules("autopar.plan")
  above = sorted(m for m in reached if m.startswith(BELOW_PLAN))
  assert not above, f"autopar.plan reaches {above}"


def test_every_module_is_in_a_stage():
  """Each module is in one of the stages' packages or a named top-level
  module (the layers contract is exhaustive; this names the stray)."""
  top = {"autopar.api", "autopar.nn", "autopar.signature", "autopar.plan", "autopar.method", "autopar.errors",
         "autopar.jax_compat", "autopar.version", "autopar.text", "autopar.disk",
         "autopar.gc_pause",
         "autopar.__main__"}
  packages = ("autopar.tools", "autopar.runtime", "autopar.backend", "autopar.planner",
              "autopar.costs", "autopar.frontend")
  stray = sorted(m for m in _graph().modules if m != "autopar" and m not in top
                 and not m.startswith(tuple(p + "." for p in packages))
                 and m not in packages)
  assert not stray, f"modules outside the stages: {stray}"


def test_the_tools_are_imported_by_nothing_below_them():
  graph = _graph()
  importers = {m for m in graph.find_modules_that_directly_import("autopar.tools")
               | {i for t in graph.find_descendants("autopar.tools")
                  for i in graph.find_modules_that_directly_import(t)}}
  below = sorted(m for m in importers if not m.startswith("autopar.tools")
                 and m not in ("autopar", "autopar.__main__"))
  assert not below, f"imported by {below}"
  assert autopar.Plan.summary    # the reading methods stay on the Plan


def test_no_module_imports_itself_through_others():
  """No circle of imports among autopar's modules (strongly connected
  components of the import graph, function-local imports included)."""
  graph = _graph()
  mods = sorted(graph.modules)
  edges = {m: sorted(graph.find_modules_directly_imported_by(m)) for m in mods}
  index, low, on, stack, circles, counter = {}, {}, set(), [], [], [0]

  def visit(v):                         # Tarjan's algorithm, iteratively
    work = [(v, iter(edges[v]))]
    index[v] = low[v] = counter[0]
    counter[0] += 1
    stack.append(v)
    on.add(v)
    while work:
      node, it = work[-1]
      for w in it:
        if w not in index:
          index[w] = low[w] = counter[0]
          counter[0] += 1
          stack.append(w)
          on.add(w)
          work.append((w, iter(edges[w])))
          break
        if w in on:
          low[node] = min(low[node], index[w])
      else:
        work.pop()
        if work:
          low[work[-1][0]] = min(low[work[-1][0]], low[node])
        if low[node] == index[node]:
          comp = []
          while True:
            w = stack.pop()
            on.discard(w)
            comp.append(w)
            if w == node:
              break
          if len(comp) > 1:
            circles.append(sorted(comp))

  for m in mods:
    if m not in index:
      visit(m)
  assert not circles, circles
