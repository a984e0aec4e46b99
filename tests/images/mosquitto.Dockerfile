# An eclipse-mosquitto:2 look-alike for machines that reach no registry (the
# container tests tag it docker.io/library/eclipse-mosquitto:2, the image the
# rendered Kubernetes manifests name): Debian's Mosquitto 2, the same paths
# (/mosquitto/config, /mosquitto/data, /mosquitto/log), the same user (1883) it
# drops to, the same default command.
ARG BASE=localhost/isthmus-base:bookworm
FROM ${BASE}
RUN apt-get update -qq \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends mosquitto >/dev/null \
 && rm -rf /var/lib/apt/lists/* \
 && groupmod -g 1883 mosquitto && usermod -u 1883 -g 1883 mosquitto \
 && mkdir -p /mosquitto/config /mosquitto/data /mosquitto/log \
 && chown -R 1883:1883 /mosquitto
EXPOSE 1883
CMD ["/usr/sbin/mosquitto", "-c", "/mosquitto/config/mosquitto.conf"]
