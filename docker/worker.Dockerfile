# An unmodified SGLang GPU image with the project's engine extension added.
ARG SGLANG_IMAGE=lmsysorg/sglang:v0.5.23
FROM ${SGLANG_IMAGE}
WORKDIR /opt/revisit
COPY pyproject.toml README.md ./
COPY engine_ext ./engine_ext
COPY launcher ./launcher
COPY bundled ./bundled
COPY plan ./plan
COPY settings ./settings
COPY store ./store
# SGLang, torch and transformers come from the base image; add only the project, and for the shared tier across
# hosts (compose.scale-out.yaml) Mooncake's client, CUDA build, unless the image has one already, and redis for
# the outcomes the gateways read, PyAV, the video decoder every worker uses (engine_ext/video_decoder.py), and
# blake3, the data plane's MACs (settings/secret.py).
RUN pip install --no-cache-dir --no-deps . && pip install --no-cache-dir lmdb redis "av>=14" "blake3>=1.0" && \
    (python -c "import mooncake.store" 2>/dev/null || pip install --no-cache-dir mooncake-transfer-engine)
ENTRYPOINT ["python", "-m", "launcher.worker"]
