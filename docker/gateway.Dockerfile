FROM python:3.11-slim
WORKDIR /opt/revisit
COPY pyproject.toml README.md ./
COPY gateway ./gateway
COPY plan ./plan
COPY settings ./settings
COPY store ./store
COPY dashboards ./dashboards
# revisit replay and revisit trace (their plots need the replay extra: pip install ".[replay]")
COPY replay ./replay
# EXTRAS=response-cache for the response cache's sentence embedder (it brings torch: pass
# --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cpu to take the CPU build)
ARG EXTRAS=""
ARG TORCH_INDEX=""
COPY requirements/response-cache.txt ./requirements/
# EXTRAS=scale-out for the shared tier's Mooncake client (it links libibverbs; compose.scale-out.yaml)
RUN case "$EXTRAS" in *scale-out*) apt-get update && apt-get install -y --no-install-recommends libibverbs1 && \
        rm -rf /var/lib/apt/lists/*;; esac && \
    if [ -n "$TORCH_INDEX" ]; then pip install --no-cache-dir --index-url "$TORCH_INDEX" torch; fi && \
    pip install --no-cache-dir ".${EXTRAS:+[$EXTRAS]}" && \
    case "$EXTRAS" in *response-cache*) pip install --no-cache-dir --no-deps -r requirements/response-cache.txt;; esac
EXPOSE 8000
ENTRYPOINT ["revisit", "gateway"]
