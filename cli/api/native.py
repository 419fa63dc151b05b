"""PLACEHOLDER: llama-server's native POST /completion, being written."""


class NativeCompletionApi:
    def parse(self, body, engine, limits):
        raise NotImplementedError

    def reply_format(self, body, served, model_name):
        raise NotImplementedError
