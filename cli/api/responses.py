"""PLACEHOLDER: OpenAI's Responses API, being written."""


class ResponseStore:
    def retrieve(self, ident):
        return None

    def delete(self, ident):
        return False


class ResponsesApi:
    def __init__(self, store):
        self.store = store

    def parse(self, body, engine, limits):
        raise NotImplementedError

    def reply_format(self, body, served, model_name):
        raise NotImplementedError
