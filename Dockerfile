# kvlookup controller and sidecar image (one image, two commands).
FROM python:3.11-slim
RUN useradd --create-home --uid 10001 kvlookup
WORKDIR /app
COPY pyproject.toml README.md ./
COPY kvlookup ./kvlookup
COPY app ./app
COPY sidecar ./sidecar
COPY bench ./bench
COPY config ./config
RUN pip install --no-cache-dir .
USER kvlookup
EXPOSE 9000 9001 9002
ENTRYPOINT ["kvlookup"]
CMD ["controller", "--host", "0.0.0.0", "--port", "9000"]
