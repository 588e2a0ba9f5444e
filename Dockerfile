# The image launch.xpk (--docker_image) and launch.jobset (--image) run: maxpar installed by install.sh itself, the
# script CI's install runs, so the image gets what CI tests. Build it from the repository root (docs/multi-host.md):
#
#   docker build -t gcr.io/PROJECT/maxpar:latest .
#   docker build --build-arg EXTRAS=hf -t gcr.io/PROJECT/maxpar:latest .   # pyproject.toml extras, comma-separated
#
# The launchers' pods run `python3 -m maxpar.train configs/base.yml ...` in WORKDIR, with the venv first on PATH.
FROM python:3.12

ARG EXTRAS=""
WORKDIR /maxpar
COPY . .
RUN bash install.sh "${EXTRAS}" && rm -rf /root/.cache/pip
ENV PATH=/maxpar/.venv/bin:$PATH
CMD ["python3", "-m", "maxpar.train", "--help"]
