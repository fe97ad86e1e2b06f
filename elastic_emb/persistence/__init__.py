"""In-process persistence of tables: the checkpoint directory format (`files`) and
`ee.save`/`ee.restore` over the registry of tables and a cluster's shards (`checkpoint`)."""
