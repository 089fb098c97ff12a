"""The messages between a process that needs compiled grammars (an engine core, an API server,
an offline LLM) and its grammar compile process (engine/grammar_process.py), msgpack over one
socket pair, never pickle:

  owner -> compile process: StartCompiler (first), then CompileJob per constraint
  compile process -> owner: CompilerReady (its vocabulary), then Compiled or CompileFailed
                            per job, in the order the jobs end
"""

from __future__ import annotations

import msgspec

from parashift.wire.message import _Msg


class StartCompiler(_Msg):
    """What the compile process loads and how far each compile may go."""

    tokenizer_path: str
    vocab_size: int  # the model's: ids past the tokenizer's are masked
    memory_bytes: int  # address space a compile may add to the warm process (RLIMIT_AS)
    max_compiles: int  # compiles running at once; more wait for one to end


class CompileJob(_Msg):
    job_id: int
    kind: str  # json, json_object, regex, choice, grammar
    text: str  # StructuredOutputsParams.key's text
    timeout_s: float  # past it the compile's process is killed
    send_grammar: bool  # False: only whether it compiles (an API server's check)


class CompilerReady(_Msg):
    tokenizer_info: str  # xgrammar's TokenizerInfo.serialize_json: compiled grammars bind to it


class Compiled(_Msg):
    job_id: int
    memory_size_bytes: int
    grammar: str = ""  # CompiledGrammar.serialize_json, when the job asked for it


class CompileFailed(_Msg):
    job_id: int
    error: str  # says which constraint field and why (a 400's message)


FromCompiler = CompilerReady | Compiled | CompileFailed

_encoder = msgspec.msgpack.Encoder()
_to_compiler = msgspec.msgpack.Decoder(StartCompiler | CompileJob)
_from_compiler = msgspec.msgpack.Decoder(FromCompiler)


def encode(msg: _Msg) -> bytes:
    return _encoder.encode(msg)


def decode_to_compiler(data: bytes) -> StartCompiler | CompileJob:
    return _to_compiler.decode(data)


def decode_from_compiler(data: bytes) -> CompilerReady | Compiled | CompileFailed:
    return _from_compiler.decode(data)
