# Sourced by the image builds' RUN steps: turns the optional build args FIND_LINKS,
# EXTRA_INDEX_URL and CA_CERT into pip's environment (an empty arg sets nothing).
if [ -n "${FIND_LINKS:-}" ]; then export PIP_FIND_LINKS="$FIND_LINKS"; fi
if [ -n "${EXTRA_INDEX_URL:-}" ]; then export PIP_EXTRA_INDEX_URL="$EXTRA_INDEX_URL"; fi
if [ -n "${CA_CERT:-}" ]; then export PIP_CERT="$CA_CERT"; fi
