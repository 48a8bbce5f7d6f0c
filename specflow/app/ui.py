"""The Gradio app: a prompt, one or two pipelines, sampling, Generate / Stop, and each step's draft
tree drawn live with a slider to replay past steps. ``specflow app [CONFIG]`` launches it."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field, fields, replace
from html import escape
from pathlib import Path

import gradio as gr

from specflow.app.render import render_step
from specflow.app.session import (MAIN_TREE_PARAMS, NO_DRAFTER, Catalog, EnginePool, Lane, PipelineForm, load_catalog,
                                  start_lane, stream, tree_param_defaults)
from specflow.app.stats import RunStats, render_stats
from specflow.config import ConfigError
from specflow.registry import DRAFTERS, TREE_BUILDERS, VERIFIERS
from specflow.sampling import SamplingParams
from specflow.tree import StepRecord

DEFAULT_PROMPT = "def fibonacci(n):\n    "
FRAME_S = 0.1        # at most ten UI updates a second while streaming; the last one always goes out
FORM_FIELDS = [f.name for f in fields(PipelineForm)][1:]   # the editable fields, name excluded

CSS = """
.sf-tree { overflow: auto; max-height: 640px; border: 1px solid #e5e7eb; border-radius: 8px; padding: 6px;
           background: #fff; }
.sf-caption { font-size: 13px; margin: 4px 0 6px; }
.sf-caption code { background: #dcfce7; padding: 0 3px; border-radius: 3px; margin-left: 4px; }
.sf-caption code.bonus { background: #fef3c7; }
.sf-legend { font-size: 12px; color: #4b5563; margin-top: 4px; display: flex; gap: 14px; }
.sf-stats .sf-row { display: flex; flex-wrap: wrap; gap: 18px; margin: 4px 0; }
.sf-value { font-size: 20px; font-weight: 600; }
.sf-label { font-size: 11px; color: #6b7280; }
.sf-state { float: right; font-size: 11px; padding: 1px 8px; border-radius: 9px; background: #e5e7eb; }
.sf-state.sf-running { background: #dbeafe; } .sf-state.sf-done { background: #dcfce7; }
.sf-state.sf-error, .sf-state.sf-stopped { background: #fee2e2; }
.sf-lane { font-size: 15px; font-weight: 600; margin: 2px 0; }
.sf-ran { font-size: 12px; font-weight: 400; color: #666; margin-left: 6px; }
.sf-error { color: #991b1b; background: #fef2f2; border: 1px solid #fecaca; border-radius: 6px; padding: 8px;
            white-space: pre-wrap; font-family: ui-monospace, monospace; font-size: 13px; }
.sf-warning { color: #92400e; }
"""


@dataclass
class LaneView:
    """What replaying a finished lane needs (kept in the browser session's gr.State)."""

    steps: list[StepRecord] = field(default_factory=list)
    texts: dict[int, str] = field(default_factory=dict)
    stats: RunStats = field(default_factory=RunStats)
    state: str = ""

    def tree_html(self, step: int) -> str:
        if not self.steps:
            return "<div class='sf-step'>No speculative step yet.</div>"
        record = self.steps[min(max(step, 1), len(self.steps)) - 1]
        return render_step(record, self.texts.get, len(self.steps))


def lane_outputs(lane: Lane, pool: EnginePool, tag: str, pinned: int | None = None) -> list:
    """The six outputs of one lane: header, text, statistics, slider, tree, view state. The tree and
    chart show the last step, or step ``pinned`` (1-based) where the user replays one during the run."""
    view = LaneView(lane.steps, {}, lane.stats, lane.state)
    for record in lane.steps:
        for t in [*record.tree["tokens"], record.bonus_token]:
            view.texts[t] = pool.token_text(t)
    ran = f" <span class='sf-ran'>{escape(lane.engine.pipeline.describe())}</span>" if lane.engine else ""
    header = f"<div class='sf-lane'>{tag} · {escape(lane.name)}{ran}</div>"
    if lane.error:
        header += f"<div class='sf-error'>{escape(lane.error)}</div>"
    n = len(lane.steps)
    shown = n if pinned is None else min(pinned, n)
    slider = gr.Slider(minimum=1, maximum=max(2, n), value=max(1, shown), step=1, visible=n > 1)  # min < max
    return [header, lane.text, render_stats(lane.stats, shown - 1 if shown else None, lane.state), slider,
            view.tree_html(shown), view]


def empty_lane_outputs(tag: str) -> list:
    """The six outputs of a lane that did not run: as the app starts."""
    slider = gr.Slider(minimum=1, maximum=2, value=1, visible=False)
    return [f"<div class='sf-lane'>{tag}</div>", "", "", slider, "", None]


def shown_fields(form: PipelineForm) -> set[str]:
    """The fields a pipeline uses: without a drafter only the drafter's type (plain decoding has no
    tree to build or verify), and of the tree numbers those its type declares."""
    if form.drafter_type == NO_DRAFTER:
        return {"drafter_type"}
    return set(FORM_FIELDS) - set(MAIN_TREE_PARAMS) | set(tree_param_defaults(form.tree_type))


def form_values(form: PipelineForm) -> list:
    """Field values and visibility (FORM_FIELDS order)."""
    shown = shown_fields(form)
    return [gr.update(value=getattr(form, name), visible=name in shown) for name in FORM_FIELDS]


class PipelinePanel:
    """The picker and editable fields of one pipeline."""

    def __init__(self, tag: str, catalog: Catalog, label: str, visible: bool = True):
        self.catalog = catalog
        form = PipelineForm.from_pipeline(catalog.pipelines[label])
        shown = shown_fields(form)

        def eid(name: str) -> str:
            return f"{name.replace('_', '-')}-{tag.lower()}"    # e.g. #drafter-params-a

        def number(name: str) -> gr.Number:
            return gr.Number(getattr(form, name), label=name, precision=0, visible=name in shown,
                             min_width=90, elem_id=eid(name))

        with gr.Column(visible=visible, elem_id=f"pipeline-{tag.lower()}") as self.column:
            self.picker = gr.Dropdown(list(catalog.pipelines), value=label, label=f"pipeline {tag}",
                                      elem_id=f"picker-{tag.lower()}")
            with gr.Row():
                drafter_type = gr.Dropdown([NO_DRAFTER, *DRAFTERS.names()], value=form.drafter_type,
                                           label="drafter", min_width=110,
                                           elem_id=eid("drafter_type"))
                tree_type = gr.Dropdown(TREE_BUILDERS.names(), value=form.tree_type, label="tree", min_width=110,
                                        visible="tree_type" in shown, elem_id=eid("tree_type"))
                verifier_type = gr.Dropdown(VERIFIERS.names(), value=form.verifier_type, label="verifier",
                                            min_width=110, visible="verifier_type" in shown,
                                            elem_id=eid("verifier_type"))
            drafter_params = gr.Textbox(form.drafter_params, label="drafter params (YAML)", max_lines=3,
                                        visible="drafter_params" in shown, elem_id=eid("drafter_params"))
            with gr.Row():
                depth, topk, num_draft_tokens = number("depth"), number("topk"), number("num_draft_tokens")
            with gr.Row():
                tree_params = gr.Textbox(form.tree_params, label="other tree params (YAML)", max_lines=3,
                                         visible="tree_params" in shown, elem_id=eid("tree_params"))
                verifier_params = gr.Textbox(form.verifier_params, label="verifier params (YAML)", max_lines=3,
                                             visible="verifier_params" in shown, elem_id=eid("verifier_params"))
        self.fields = [drafter_type, drafter_params, tree_type, depth, topk, num_draft_tokens, tree_params,
                       verifier_type, verifier_params]
        self.picker.change(lambda name: form_values(PipelineForm.from_pipeline(self.catalog.pipelines[name])),
                           self.picker, self.fields)
        # a new type's parameters: the old type's would be unknown keys
        tree_type.input(self.tree_type_changed, [drafter_type, tree_type], [depth, topk, num_draft_tokens, tree_params])
        drafter_type.input(self.drafter_type_changed, self.fields, self.fields)
        verifier_type.input(lambda kind: self.listed_params("verifier", kind), verifier_type, verifier_params)

    def tree_type_changed(self, drafter_type: str, tree_type: str) -> list:
        """The tree numbers the new type declares (its defaults) and its listed params."""
        form = PipelineForm("", drafter_type, tree_type=tree_type, **tree_param_defaults(tree_type),
                            tree_params=self.listed_params("tree", tree_type))
        return form_values(form)[3:7]

    def drafter_type_changed(self, *values) -> list:
        """The new drafter type's listed params; the tree and verifier fields shown only with a drafter."""
        form = PipelineForm("", **dict(zip(FORM_FIELDS, values)))
        form.drafter_params = self.listed_params("drafter", form.drafter_type)
        return form_values(form)

    def listed_params(self, component: str, kind: str) -> str:
        """The params of the first listed pipeline whose drafter (tree, verifier) is of type ``kind``
        (a checkpoint path to start from), else none."""
        forms = (PipelineForm.from_pipeline(p) for p in self.catalog.pipelines.values())
        return next((getattr(f, f"{component}_params") for f in forms if getattr(f, f"{component}_type") == kind),
                    "{}")


class OutputPanel:
    """One lane's output: header (and error), generated text, statistics, step slider, tree."""

    def __init__(self, tag: str, visible: bool = True):
        t = tag.lower()
        with gr.Column(visible=visible, elem_id=f"lane-{t}") as self.column:
            self.header = gr.HTML(f"<div class='sf-lane'>{tag}</div>", elem_id=f"header-{t}")
            self.text = gr.Textbox(label="generated text", lines=4, max_lines=8, elem_id=f"text-{t}")
            self.stats = gr.HTML(elem_id=f"stats-{t}")
            self.slider = gr.Slider(1, 2, value=1, step=1, label="step (drag to replay)", visible=False,
                                    elem_id=f"slider-{t}")
            self.tree = gr.HTML(elem_id=f"tree-{t}")
            self.view = gr.State(None)
        self.outputs = [self.header, self.text, self.stats, self.slider, self.tree, self.view]


def header_markdown(catalog: Catalog, pool: EnginePool) -> str:
    dtype = str(pool.dtype).removeprefix("torch.")
    lines = ["## specflow · draft trees, live",
             f"Target `{catalog.engine.target}` on {pool.device}/{dtype}. Each speculative step's draft tree: token and "
             "draft probability q per node, the accepted path in green, rejected nodes faded, the bonus "
             "token (sampled from the target) dashed."]
    lines += [f"<span class='sf-warning'>skipped {escape(note)}</span>" for note in catalog.notes]
    return "\n\n".join(lines)


def build_app(catalog: Catalog, pool: EnginePool) -> gr.Blocks:
    """The Blocks app over ``catalog``'s pipelines; generation runs on ``pool``'s engines."""
    labels = list(catalog.pipelines)
    first = catalog.pipelines[labels[0]]
    second = next((name for name, p in catalog.pipelines.items()
                   if p.drafter and (p.tree, p.drafter) != (first.tree, first.drafter)), labels[-1])
    stops: dict[str, threading.Event] = {}   # each browser session's Stop
    pins: dict[tuple[str, str], int] = {}    # (session, lane tag) -> the step replayed while a run streams
    s = catalog.sampling

    def stop_event(request: gr.Request) -> threading.Event:
        return stops.setdefault(request.session_hash, threading.Event())

    def stop_run(request: gr.Request) -> None:
        stop_event(request).set()

    def arm(request: gr.Request) -> None:  # at the click: a Stop pressed while the run waits in the queue holds
        stop_event(request).clear()
        unpin(request)

    def unpin(request: gr.Request) -> None:
        for tag in "AB":
            pins.pop((request.session_hash, tag), None)

    def forget(request: gr.Request) -> None:   # (a closed tab)
        stops.pop(request.session_hash, None)
        unpin(request)

    def replayer(tag: str):
        def replay(step: float, view: LaneView | None, request: gr.Request) -> tuple[str, str]:
            """Tree and statistics of step ``step`` (1-based) of the lane's steps so far. While a run
            streams, a step before the last keeps its frames on that step; the last follows them again."""
            if view is None or not view.steps:
                return gr.skip(), gr.skip()
            if int(step) < len(view.steps):
                pins[(request.session_hash, tag)] = int(step)
            else:
                pins.pop((request.session_hash, tag), None)
            return view.tree_html(int(step)), render_stats(view.stats, int(step) - 1, view.state)
        return replay

    with gr.Blocks(title="specflow · draft trees", analytics_enabled=False) as demo:
        gr.Markdown(header_markdown(catalog, pool))
        with gr.Row():
            with gr.Column(scale=2, min_width=320):
                prompt = gr.Textbox(DEFAULT_PROMPT, label="prompt", lines=5, elem_id="prompt")
                with gr.Accordion("sampling", open=False):
                    temperature = gr.Slider(0.0, 2.0, value=s.temperature, step=0.05, label="temperature")
                    top_p = gr.Slider(0.05, 1.0, value=s.top_p, step=0.05, label="top_p")
                    top_k = gr.Number(s.top_k, label="top_k (-1: off)", precision=0)
                    max_tokens = gr.Slider(1, 512, value=s.max_tokens, step=1, label="max_tokens", elem_id="max-tokens")
                    seed = gr.Number(s.seed, label="seed", precision=0)
                    ignore_eos = gr.Checkbox(s.ignore_eos, label="ignore EOS")
                side_by_side = gr.Checkbox(False, label="side by side: two pipelines on the same prompt",
                                           elem_id="side-by-side")
                with gr.Row():
                    generate = gr.Button("Generate", variant="primary", elem_id="generate")
                    stop_button = gr.Button("Stop", variant="stop", elem_id="stop")
                status = gr.HTML(elem_id="status")
            with gr.Column(scale=5):
                with gr.Row():
                    panel_a = PipelinePanel("A", catalog, labels[0])
                    panel_b = PipelinePanel("B", catalog, second, visible=False)
        with gr.Row(equal_height=False):
            out_a = OutputPanel("A")
            out_b = OutputPanel("B", visible=False)

        side_by_side.change(lambda on: [gr.Column(visible=on), gr.Column(visible=on)], side_by_side,
                            [panel_b.column, out_b.column])
        for tag, out in (("A", out_a), ("B", out_b)):
            out.slider.input(replayer(tag), [out.slider, out.view], [out.tree, out.stats], concurrency_limit=None)

        def run(request: gr.Request, prompt_text, temp, p, k, n, seed_value, no_eos, both, *values):
            stop = stop_event(request)
            try:
                params = SamplingParams(temperature=temp, top_p=p, top_k=-1 if k is None else int(k),
                                        max_tokens=int(n), seed=None if seed_value is None else int(seed_value),
                                        ignore_eos=no_eos)
            except ValueError as e:
                yield [f"<div class='sf-error'>sampling: {escape(str(e))}</div>"] + [gr.skip()] * 12
                return
            # values: picker A, its nine fields, picker B, its nine fields
            forms = [(values[0], values[1:10])] + ([(values[10], values[11:])] if both else [])
            lanes = []
            for name, form in forms:
                try:
                    pipeline = PipelineForm(name, **dict(zip(FORM_FIELDS, form))).to_pipeline()
                except ConfigError as e:
                    lanes.append(Lane.failed(name, e))
                    continue
                try:   # (a listed pipeline that no longer validates: the form's fields differ from it)
                    listed = PipelineForm.from_pipeline(catalog.pipelines[name]).to_pipeline()
                except (ConfigError, KeyError):
                    listed = None
                if listed is None or replace(listed, name=pipeline.name) != pipeline:
                    # (fields edited, or not yet refilled for a pipeline just picked): say so
                    pipeline = replace(pipeline, name=f"{name} (edited)")
                lanes.append(start_lane(pool, pipeline, prompt_text, params, lanes))
            shown = 0.0
            for current in stream(pool, lanes, prompt_text, params, stop):
                if time.perf_counter() - shown >= FRAME_S:
                    shown = time.perf_counter()
                    yield frame(current, request, final=False)
            yield frame(lanes, request, final=True)

        def frame(lanes: list[Lane], request: gr.Request, final: bool) -> list:
            states = ", ".join(f"{tag}: {lane.state}" for tag, lane in zip("AB", lanes))
            if not final and all(lane.state != "running" for lane in lanes):
                states += " · measuring plain decoding of the same prompt for the speedup…"
            outs = [f"<div class='sf-status' data-done='{final}'>{states}</div>"]
            for tag, lane in zip("AB", lanes):
                outs += lane_outputs(lane, pool, tag, pins.get((request.session_hash, tag)))
            for tag in "AB"[len(lanes):]:  # a lane this run has not: blank, not an earlier run's
                outs += empty_lane_outputs(tag)
            return outs

        inputs = [prompt, temperature, top_p, top_k, max_tokens, seed, ignore_eos, side_by_side,
                  panel_a.picker, *panel_a.fields, panel_b.picker, *panel_b.fields]
        generate.click(arm, None, None, queue=False).then(run, inputs, [status, *out_a.outputs, *out_b.outputs],
                                                          concurrency_limit=1)
        stop_button.click(stop_run, None, None, concurrency_limit=None)
        demo.unload(forget)
    return demo


def launch(config: str | Path | None = None, host: str = "127.0.0.1", port: int = 7860,
           prevent_thread_lock: bool = False, quiet: bool = False) -> gr.Blocks:
    """Load the catalog and target, build the app and serve it on ``host:port``."""
    catalog = load_catalog(config)
    demo = build_app(catalog, EnginePool(catalog.engine))
    demo.queue(default_concurrency_limit=1)
    demo.launch(server_name=host, server_port=port, prevent_thread_lock=prevent_thread_lock, quiet=quiet,
                css=CSS, footer_links=[])
    return demo
