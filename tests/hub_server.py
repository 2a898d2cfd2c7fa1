"""A stand-in for the Hugging Face hub's HTTP API on loopback, the part ``huggingface_hub``'s own client uses to make
a repository and commit small files to it (``relayrl push``'s test: the real client, over real HTTP):

    POST /api/repos/create                              {"name", "organization", "private" or "visibility"}
    POST /api/validate-yaml                             a model card's front matter: accepted
    POST /api/models/{ns}/{name}/preupload/{revision}   every file "regular" (sent inline, not through LFS)
    POST /api/models/{ns}/{name}/commit/{revision}      NDJSON: a header, then each file base64-encoded

``repos`` holds what arrived: repo id -> {"private": bool, "files": {path: bytes}, "commits": [message]}; the
token each request carried is in ``tokens``."""

import base64
import json

from tests.openai_server import Server


class HubServer(Server):
    last = None  # (the HubServer started last: a test reads what arrived)

    def __init__(self):
        self.repos: dict = {}
        self.tokens: list = []
        super().__init__()
        HubServer.last = self

    def _app(self):
        from fastapi import FastAPI, Request

        app = FastAPI()

        def seen(request: Request) -> None:
            self.tokens.append(request.headers.get("authorization"))

        @app.post("/api/repos/create")
        async def create(request: Request):
            seen(request)
            body = await request.json()
            repo = f"{body['organization']}/{body['name']}" if body.get("organization") else body["name"]
            private = bool(body.get("private")) or body.get("visibility") == "private"  # (newer clients: visibility)
            self.repos.setdefault(repo, {"private": private, "files": {}, "commits": []})
            return {"url": f"{self.base}/{repo}", "name": repo}

        @app.post("/api/validate-yaml")
        async def validate(request: Request):  # (the client checks a model card's front matter before a commit)
            seen(request)
            return {"errors": [], "warnings": []}

        @app.post("/api/models/{ns}/{name}/preupload/{revision}")
        async def preupload(ns: str, name: str, revision: str, request: Request):
            seen(request)
            body = await request.json()
            return {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                              for f in body["files"]], "commitOid": "0" * 40}

        @app.post("/api/models/{ns}/{name}/commit/{revision}")
        async def commit(ns: str, name: str, revision: str, request: Request):
            seen(request)
            repo = self.repos[f"{ns}/{name}"]
            for line in (await request.body()).decode().splitlines():
                item = json.loads(line)
                if item["key"] == "header":
                    repo["commits"].append(item["value"]["summary"])
                elif item["key"] == "file":
                    repo["files"][item["value"]["path"]] = base64.b64decode(item["value"]["content"])
            oid = f"{len(repo['commits']):040x}"
            return {"commitUrl": f"{self.base}/{ns}/{name}/commit/{oid}", "commitOid": oid, "pullRequestUrl": None}

        return app

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> str:
        super().__enter__()
        return self.base
