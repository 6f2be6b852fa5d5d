# One image for the api, the worker and the migrate job (docker-compose.yml picks the command).
FROM python:3.11-slim
WORKDIR /app
# The pinned, hashed versions first (a layer that changes only with the lock), then the package without deps.
COPY requirements-service.lock ./
RUN pip install --no-cache-dir --require-hashes -r requirements-service.lock
COPY pyproject.toml README.md alembic.ini ./
COPY fusetune ./fusetune
COPY migrations ./migrations
RUN pip install --no-cache-dir --no-deps ".[tracking,ray]"
ENV FUSETUNE_DATA_DIR=/data
VOLUME ["/data"]
EXPOSE 8000
CMD ["fusetune", "serve", "--host", "0.0.0.0"]
