"""Files as data: what meshforge reads from a user is a regular file read no further than a cap
(``files``), parsed with depth and size limits (``parse``) and checked against a schema
(``schema``); what it writes never goes through a link it did not make (``links``). The bottom
of the package: it imports nothing of meshforge but ``errors``, so config/, data/, checkpoint/,
models/ and report/ read files the same way."""
