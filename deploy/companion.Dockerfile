# The companion's image, built from the repository root:
#   docker build -f deploy/companion.Dockerfile -t registry.example.com/llm-ratelimit-companion:0.1.0 .
# Stage 1 compiles it (only the companion and the protocol crate it uses); stage 2 is a
# distroless image with the C runtime and nothing else, running as a non-root user.

# The toolchain this repository is built and tested with.
FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --locked --release -p llm-ratelimit-companion \
 && cp target/release/llm-ratelimit-companion /llm-ratelimit-companion

FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /llm-ratelimit-companion /usr/local/bin/llm-ratelimit-companion
# Listen on every interface inside the pod (the default is loopback).
ENV LLMRL_LISTEN=0.0.0.0:8080
EXPOSE 8080
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/llm-ratelimit-companion"]
