"""Readers: small Qwen2.5-VLs trained here to read panels of labelled fields, which judge reuse by their answers.

Two are bundled: ``reader`` (4 layers, "K?" only), which reads a field at its first layer, and ``oracle`` (8 layers,
"K?", "K=L?" and questions over two images), trained so that its answers come from late-layer image KV: the one
that can tell a good approximate-reuse plan from a bad one.

    panels     the pictures (and pairs of panels with fields changed)
    questions  the questions and one-token answers, and a question's sibling (other values, same layout)
    swap       the oracle's training-time attention: below layer 3 the question sees its sibling's image
    batches    questions made model inputs, and what each image token is taught to say
    train      ``python -m bundled.reader.train --size reader|oracle``: training on CPU, resumable, exported as
    artifacts  the committed weights, log and checksums the bundled build (``build_model("qwen2_5_vl", size)``)
               turns into a servable model directory

Its evaluation harness, an offline tool, is ``python -m offline.reader_eval``.
"""
