# rdmig: one image with both programs, rdmig-agent and rdmig-controller.
#   docker build --build-arg RDMIG_REVISION=$(git rev-parse --short=12 HEAD) -t REGISTRY/rdmig:0.1.0 .
#   docker push REGISTRY/rdmig:0.1.0
# (docs/deploy.md; tests/deploy/test_dockerfile.py checks the packages and the build steps;
# tests/deploy/test_image_build.py builds this file with podman and runs the programs inside.)

# ---- build: the project's CMake, Debian 12's compiler and libraries ----------------------
FROM debian:12 AS build
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      cmake g++ make ccache pkg-config libibverbs-dev librdmacm-dev libcpp-httplib-dev \
      nlohmann-json3-dev prometheus-cpp-dev libyaml-cpp-dev libssl-dev \
      libgrpc++-dev libprotobuf-dev protobuf-compiler protobuf-compiler-grpc libnftables-dev libvirt-dev \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
# Only the build inputs, so that a change to docs, charts or tests reuses the compiled layers.
# .git is not in the context (.dockerignore): the revision comes in as a build argument (without
# one, --version says "unknown"), declared after the copies so that no earlier layer depends on it.
COPY CMakeLists.txt ./
COPY cmake/ cmake/
COPY bench/stream/ bench/stream/
COPY src/ src/
COPY agent/ agent/
COPY controller/ controller/
ARG RDMIG_REVISION=unknown
# The compile goes through ccache with its objects in a build cache mount (BuildKit and buildah both
# keep it between builds, outside the image): a rebuild after a source change recompiles only what
# changed, although the layers from here on are rebuilt for every revision. Paths under /src are
# hashed relative and the build directory is left out of the key, as scripts/cache-env.sh does for
# a checkout: the same sources built by scripts/build.sh with the same packages and the same
# locale give the same objects (the image test hands the host's cache in; ccache hashes LANG, so
# the build stage has the C.UTF-8 of Debian's hosts). RelWithDebInfo as scripts/build.sh builds,
# so the image ships the code generation the test suite ran (the binaries are stripped below).
ENV CCACHE_BASEDIR=/src CCACHE_NOHASHDIR=1 LANG=C.UTF-8
RUN cmake -S . -B build -DCMAKE_BUILD_TYPE=RelWithDebInfo -DRDMIG_BUILD_TESTS=OFF -DRDMIG_UNITY_BUILD=ON -DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DRDMIG_REVISION="${RDMIG_REVISION}"
RUN --mount=type=cache,target=/root/.cache/ccache,id=rdmig-ccache cmake --build build -j "$(nproc)" --target rdmig-agent rdmig-controller
RUN install -D -m 0755 build/agent/rdmig-agent /out/usr/local/bin/rdmig-agent \
 && install -D -m 0755 build/controller/rdmig-controller /out/usr/local/bin/rdmig-controller \
 && strip --strip-unneeded /out/usr/local/bin/rdmig-agent /out/usr/local/bin/rdmig-controller

# ---- runtime: the shared libraries the programs link, rdma-core's user-space providers ----
FROM debian:12-slim
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      libibverbs1 librdmacm1 ibverbs-providers libcpp-httplib0.11 libyaml-cpp0.7 \
      libprometheus-cpp-core1.0 libssl3 libgrpc++1.51 libprotobuf32 libnftables1 libvirt0 \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 65532 rdmig \
 && useradd --system --uid 65532 --gid 65532 --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin rdmig
# The config files change less often than the binaries: copied first.
COPY agent/agent.yaml /etc/rdmig/agent.yaml
COPY controller/controller.yaml /etc/rdmig/controller.yaml
COPY --from=build /out/ /
# The controller runs as this user; the agent DaemonSet runs as root (QMP sockets, RDMA, KubeVirt mode;
# only the capabilities of its modes: docs/security.md "The agent's privileges").
USER 65532:65532
EXPOSE 7470 7471 7472 8080
ENTRYPOINT []
CMD ["/usr/local/bin/rdmig-controller", "--config", "/etc/rdmig/controller.yaml"]
