# Redis from Debian's package (the cluster's store and job queue; docs/cluster.md).
# deploy/container.sh builds it on a base that mmdebstrap made with redis-server already in it
# (no registry, no apt in the build); elsewhere the default base installs it with apt:
#   docker build -f deploy/images/redis.Dockerfile -t sparkv-redis deploy/images
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}
RUN command -v redis-server >/dev/null || (apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends redis-server \
    && rm -rf /var/lib/apt/lists/*)
RUN mkdir -p /data && chown redis:redis /data
USER redis
WORKDIR /data
EXPOSE 6379
ENTRYPOINT ["redis-server"]
CMD ["--bind", "0.0.0.0", "--protected-mode", "no", "--dir", "/data", "--appendonly", "yes", "--appendfsync", "everysec"]
