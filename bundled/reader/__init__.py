"""The reader: a small Qwen2.5-VL trained here to read panels of labelled fields, the quality oracle for reuse.

    panels     the pictures, questions and answers (and pairs of panels with fields changed)
    train      ``python -m bundled.reader.train``: training from scratch on CPU, resumable, exported as
    artifacts  the committed weights, log and checksums the bundled build (``build_model("qwen2_5_vl", "reader")``)
               turns into a servable model directory

Its evaluation harness, an offline tool, is ``python -m offline.reader_eval``.
"""
