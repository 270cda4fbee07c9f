# The trainvitals image: collector, dashboard and the reference trainer, on CPU.
# docker-compose.yml runs each of them from this one image (`trainvitals <command>`).
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# CPU-only torch from PyTorch's own index, as a user without a GPU would install it:
#   pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
# The default PyPI wheel bundles CUDA libraries (gigabytes this image never uses). It comes
# first, in its own layer, so that editing the project does not download torch again.
# For a GPU image, start from a CUDA base image and drop --index-url.
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"

WORKDIR /opt/trainvitals
# Only what the package is built from (pyproject.toml maps these folders to
# trainvitals.*); .dockerignore keeps stores, venvs and caches out of the context.
COPY pyproject.toml README.md ./
COPY trainvitals ./trainvitals
COPY trainer ./trainer
COPY hooks ./hooks
COPY collector ./collector
COPY analyzer ./analyzer
COPY dashboard ./dashboard
COPY supervisor ./supervisor
# torch is already satisfied (pyproject asks torch>=2.6), so pip keeps the CPU build.
RUN pip install .

# An unprivileged user; /data holds the collector's DuckDB store (a volume in compose).
RUN useradd --create-home --uid 10001 trainvitals && mkdir /data && chown trainvitals /data
USER trainvitals
WORKDIR /data

# collector, dashboard
EXPOSE 8000 8501
ENTRYPOINT ["trainvitals"]
CMD ["--help"]
