"""Trace replay: what an operator runs to see whether the gateway pays off on their traffic, and how.

- :mod:`replay.trace`: the trace format (JSON Lines), reading and checking it, images inlined when replayed;
- :mod:`replay.maker`: traces made from real images on this machine (documents, video, photos, forms);
- :mod:`replay.importer`: traces from logs of arrival times and image hashes;
- :mod:`replay.runner`: replaying a trace against a running gateway, resumably;
- :mod:`replay.report`: the report (JSON, Markdown) and plots;
- :mod:`replay.cli`: ``revisit replay`` and ``revisit trace``.

It drives a gateway from outside, over HTTP, as clients do: it imports nothing of the gateway.
"""
