# kvlookup controller and sidecar image (one image, two commands).
FROM python:3.11-slim
RUN useradd --create-home --uid 10001 kvlookup
WORKDIR /app
COPY pyproject.toml setup.py README.md ./
COPY kvlookup ./kvlookup
COPY app ./app
COPY sidecar ./sidecar
COPY bench ./bench
COPY config ./config
# a C compiler for the build only: the optional hot-path extension (kvlookup._native, setup.py)
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && pip install --no-cache-dir . \
    && apt-get purge -y gcc libc6-dev && apt-get autoremove -y && rm -rf /var/lib/apt/lists/*
USER kvlookup
EXPOSE 9000 9001 9002
ENTRYPOINT ["kvlookup"]
CMD ["controller", "--host", "0.0.0.0", "--port", "9000"]
