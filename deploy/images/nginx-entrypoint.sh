#!/bin/sh
# Makes the private directory of the rendered config (pid, logs, temp files, the frame cache;
# the workers run as www-data), checks the config, then runs nginx in the foreground.
set -eu
conf=${SPARKV_NGINX_CONF:-/etc/sparkv/nginx.conf}
dir=${SPARKV_NGINX_DIR:-/var/cache/sparkv}
mkdir -p "$dir/logs" "$dir/tmp" "$dir/cache"
chown -R www-data "$dir/tmp" "$dir/cache"
chmod 700 "$dir/cache"
nginx -t -q -c "$conf"
exec nginx -c "$conf" -g 'daemon off;'
