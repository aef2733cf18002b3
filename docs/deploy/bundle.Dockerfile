# The init container's image of docs/deploy/kubernetes.yaml: busybox and the bundle's tarball.
# The build context is the directory the bundle was built in, e.g. for
#   python3 -m npu_shim bundle /srv/npu-shim
# run
#   docker build -f docs/deploy/bundle.Dockerfile -t <your registry>/npu-shim-bundle:<version> /srv
ARG BASE=docker.io/library/busybox:1.36
FROM ${BASE}
COPY npu-shim.tar.gz /npu-shim.tar.gz
