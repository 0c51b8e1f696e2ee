"""The network services' shared scaffolding (``services/common``: the token header, TLS, the
request guard, settings helpers, model sources) and the coordinator service. The weight-sync
library is ``deltarl.weightsync`` (weightsync/), its storage ``deltarl.buckets`` (buckets/)."""
