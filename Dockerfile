# The driver's container image: `dra-driver` (kubelet plugin + slice publisher, and the
# other subcommands) in a virtual environment on a slim Python base.
#
#   docker build -t <registry>/gpu-dra-driver:0.1.0 .      (or: podman build / buildah bud)
#
# The tests build this same file with buildah, offline apart from the package registries
# (hack/image/build.sh). NVML (libnvidia-ml.so) is not in the image: it comes from the
# host's driver root at run time, mounted by the Helm chart.
#
# The base, pinned: by default the base is a tag, which moves. For a release build, pin it by
# the digest of the manifest you checked (`docker buildx imagetools inspect`, `skopeo inspect`
# or `crane digest` of python:3.11-slim-bookworm), and pass the same digest for the label:
#
#   docker build --build-arg PYTHON_IMAGE=docker.io/library/python:3.11-slim-bookworm@sha256:<digest> \
#                --build-arg PYTHON_DIGEST=sha256:<digest> -t <registry>/gpu-dra-driver:0.1.0 .
#
# This file does not hard-code an upstream digest: none can be checked from where it is
# built and tested (no registry), and a digest left in place pins the CVEs of its day. The
# test build (hack/image/build.sh) pins the base it has in local storage the same way.
ARG PYTHON_IMAGE=docker.io/library/python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
# A CA bundle for pip behind a TLS-intercepting proxy (the build script passes one in);
# left unset, pip uses its own certifi bundle.
ARG PIP_CERT
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY dra_driver/ dra_driver/
COPY controller/ controller/
COPY deploy/ deploy/
# Wheel first, then install it with its dependencies: the image holds what `pip install
# gpu-dra-driver` would give a user, not the source tree. The driver's environment is made
# without pip (and so without setuptools): pip runs from a tool environment that stays in this
# stage (`pip --python`), and takes dependencies only as wheels, so nothing is compiled.
RUN python3 -m venv /opt/pip-tool \
 && python3 -m venv --without-pip /opt/dra-driver \
 && /opt/pip-tool/bin/pip wheel --no-deps --wheel-dir /wheels . \
 && /opt/pip-tool/bin/pip --python /opt/dra-driver/bin/python install --only-binary=:all: /wheels/*.whl
# The SBOM of what the image runs (CycloneDX JSON, by cyclonedx-bom from PyPI, pinned):
# every Python package in the driver's environment with its version, licence and purl. It
# covers the Python environment, not the base's Debian packages. The tool stays in this
# stage; only its output goes into the image, at /opt/dra-driver/sbom.cdx.json.
ARG CYCLONEDX_BOM=7.5.0
RUN python3 -m venv /opt/sbom-tool \
 && /opt/sbom-tool/bin/pip install --quiet "cyclonedx-bom==${CYCLONEDX_BOM}" \
 && /opt/sbom-tool/bin/cyclonedx-py environment --pyproject pyproject.toml --of JSON --output-reproducible \
      -o /opt/dra-driver/sbom.cdx.json /opt/dra-driver/bin/python

FROM ${PYTHON_IMAGE}
# The base as the FROM line named it, and its manifest digest (empty when not pinned): the OCI
# annotations org.opencontainers.image.base.name and .base.digest, as labels.
ARG PYTHON_IMAGE
ARG PYTHON_DIGEST=""
ARG VERSION=0.1.0
ARG REVISION=unknown
# Where the sources came from (a repository URL); the build script passes the git remote.
ARG SOURCE=unknown
LABEL org.opencontainers.image.title="gpu-dra-driver" \
      org.opencontainers.image.description="Kubernetes DRA driver for NVIDIA GPUs: kubelet plugin and ResourceSlice publisher" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.source="${SOURCE}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.base.name="${PYTHON_IMAGE}" \
      org.opencontainers.image.base.digest="${PYTHON_DIGEST}"
COPY --from=build /opt/dra-driver /opt/dra-driver
ENV PATH=/opt/dra-driver/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    PYTHONUNBUFFERED=1
# Non-root by default (inventory, cdi generate, controller need nothing more). The kubelet
# plugin writes sockets, checkpoints and CDI specs in root-owned host directories: the Helm
# chart runs that container as root.
USER 65532:65532
ENTRYPOINT ["dra-driver"]
CMD ["--help"]
