"""The Gradio app: a prompt, one or two pipelines, sampling, Generate / Stop, and each step's draft
tree drawn live with a slider to replay past steps. ``specflow app [CONFIG]`` launches it."""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from html import escape
from pathlib import Path

import gradio as gr

from specflow.app.panels import FORM_FIELDS, LaneView, OutputPanel, PipelinePanel, empty_lane_outputs, lane_outputs
from specflow.app.session import Catalog, EnginePool, Lane, PipelineForm, load_catalog, start_lane, stream
from specflow.app.stats import render_stats
from specflow.config import ConfigError
from specflow.sampling import SamplingParams

DEFAULT_PROMPT = "def fibonacci(n):\n    "
FRAME_S = 0.1        # at most ten UI updates a second while streaming; the last one always goes out

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
