# nginx from Debian's nginx-light (the cluster's balancer and frame cache; docs/cluster.md).
# It runs the config rendered from deploy/nginx.conf (mounted at /etc/sparkv/nginx.conf, its
# DIR placeholder set to /var/cache/sparkv): nginx-entrypoint.sh makes that directory first.
#   docker build -f deploy/images/nginx.Dockerfile -t sparkv-nginx deploy/images
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}
RUN command -v nginx >/dev/null || (apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends nginx-light \
    && rm -rf /var/lib/apt/lists/*)
COPY nginx-entrypoint.sh /usr/local/bin/nginx-entrypoint.sh
EXPOSE 8080
ENTRYPOINT ["/bin/sh", "/usr/local/bin/nginx-entrypoint.sh"]
