# One image for the api, the worker and the migrate job (docker-compose.yml picks the command).
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md alembic.ini ./
COPY fusetune ./fusetune
COPY migrations ./migrations
RUN pip install --no-cache-dir ".[tracking]"
ENV FUSETUNE_DATA_DIR=/data
VOLUME ["/data"]
EXPOSE 8000
CMD ["fusetune", "serve", "--host", "0.0.0.0"]
