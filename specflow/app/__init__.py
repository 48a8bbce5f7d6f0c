"""The draft-tree visualizer: ``render`` (StepRecord -> SVG, pure), ``stats`` (running statistics),
``session`` (catalog, engines, streamed generation) and ``ui`` (the Gradio app; needs the ``app`` extra)."""
