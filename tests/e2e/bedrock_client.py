"""AWS Bedrock as the tests under tests/e2e/ call it through Envoy: a boto3
bedrock-runtime client with fake credentials (the mock checks every SigV4 signature with
SECRET, whatever the access key id), and the Converse and InvokeModel requests they send."""

import json

import boto3
from botocore.config import Config

STORY = "Tell me a story about rate limits."
MAX_TOKENS = 300
# The mock checks signatures with this secret whatever the access key id; a test makes a
# tenant by choosing an access key id.
SECRET = "mock-bedrock-secret"
CLAUDE = "anthropic.claude-3-haiku-20240307-v1:0"  # boto3 sends the colon as %3A
NOVA = "us.amazon.nova-lite-v1:0"


def bedrock(port, access_key, secret=SECRET, headers=None):
    """A bedrock-runtime client aimed at Envoy, retries off (boto3 retries throttling by
    default); `headers` (the mock's per-request controls) are added after signing."""
    client = boto3.client(
        "bedrock-runtime", endpoint_url=f"http://127.0.0.1:{port}", region_name="us-east-1",
        aws_access_key_id=access_key, aws_secret_access_key=secret, aws_session_token=None,
        config=Config(retries={"mode": "standard", "total_max_attempts": 1}, read_timeout=30),
    )
    if headers:
        def add_headers(request, **_):
            for name, value in headers.items():
                request.headers[name] = value
        client.meta.events.register("before-send.bedrock-runtime.*", add_headers)
    return client


def converse_args(model=NOVA):
    return {"modelId": model, "messages": [{"role": "user", "content": [{"text": STORY}]}],
            "inferenceConfig": {"maxTokens": MAX_TOKENS}}


def invoke_args(model=CLAUDE):
    body = {"anthropic_version": "bedrock-2023-05-31", "max_tokens": MAX_TOKENS,
            "messages": [{"role": "user", "content": STORY}]}
    return {"modelId": model, "body": json.dumps(body), "contentType": "application/json", "accept": "application/json"}
