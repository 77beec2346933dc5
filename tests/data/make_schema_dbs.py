"""Regenerates tests/data/schema_0001.sqlite: a tiny database at schema 0001 holding one run, one trial and
one winner, for the upgrade test. Run from the repository root: python tests/data/make_schema_dbs.py"""

import json
import sqlite3
from pathlib import Path

from k3tune.store.db import Database

OUT = Path(__file__).with_name("schema_0001.sqlite")

if __name__ == "__main__":
    OUT.unlink(missing_ok=True)
    db = Database(OUT, check_schema=False)
    db.migrate("0001")
    db.dispose()
    c = sqlite3.connect(OUT)
    c.execute("PRAGMA journal_mode=DELETE")
    c.execute("INSERT INTO hardware VALUES (1,'abc','sim:NVIDIA GB300|cc10.3|160sm|288GiB','NVIDIA GB300','10.3',160,288,"
              "'simulated','simulated',1)")
    c.execute("INSERT INTO software VALUES (1,'def','2.13.0','4.8.1','0.0.9','old')")
    c.execute("INSERT INTO runs VALUES (1,'k3tune sweep','simulated','h','h:1:1','x',1,1,'2026-11-01 00:00:00',NULL,'done')")
    dims = json.dumps({"M": 1, "N": 7168, "K": 768})
    c.execute("INSERT INTO problems VALUES (1,'kda.o_proj[M=1,N=7168,K=768]','kda.o_proj','gemm',?)", (dims,))
    c.execute("INSERT INTO trials VALUES (1,1,1,1,'gemm.cublas','d1','gemm.cublas','{}','{}',0,'ok','simulated',5.0,0.1,9,0,NULL,"
              "'2026-11-01 00:00:00')")
    c.execute("INSERT INTO winners VALUES (1,1,1,'od','simulated','gemm.cublas','d1','{}',5.0,0.1,NULL,'[]',1,1,'',"
              "'2026-11-01 00:00:00')")
    c.commit()
    c.execute("VACUUM")
    c.close()
    print(OUT, OUT.stat().st_size)
