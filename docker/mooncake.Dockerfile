# A Mooncake Store cluster's processes (mooncake_master, and mooncake_client as a storage node) from the package
# the shared tier's client comes from. CPU build: TCP transfers; for RDMA take the GPU hosts' build instead.
FROM python:3.11-slim
RUN apt-get update && apt-get install -y --no-install-recommends libibverbs1 && rm -rf /var/lib/apt/lists/* && \
    pip install --no-cache-dir mooncake-transfer-engine-non-cuda==0.3.13.post1
