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
RUN pip install --no-cache-dir .
EXPOSE 8000
ENTRYPOINT ["revisit", "gateway"]
