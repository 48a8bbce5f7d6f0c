"""The app's panels: one pipeline's picker and editable fields, and one lane's outputs (header,
text, statistics, step slider, tree) with what replaying its steps needs."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from html import escape

import gradio as gr

from specflow.app.render import render_step
from specflow.app.session import (MAIN_TREE_PARAMS, NO_DRAFTER, Catalog, EnginePool, Lane, PipelineForm,
                                  tree_param_defaults)
from specflow.app.stats import RunStats, render_stats
from specflow.registry import DRAFTERS, TREE_BUILDERS, VERIFIERS
from specflow.tree import StepRecord

FORM_FIELDS = [f.name for f in fields(PipelineForm)][1:]   # the editable fields, name excluded


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
