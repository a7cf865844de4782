"""`--keys` of `lockstep verify` and `lockstep diff` with text keys: a key holding a comma, and what a diff
over some keys says when they would not change."""

from __future__ import annotations

import json
import subprocess
import sys

SHOP = """
create schema "Shop-Inv";
create table "Shop-Inv".warehouse (code text primary key);
create table "Shop-Inv".stock (id bigint generated always as identity primary key,
    warehouse text not null references "Shop-Inv".warehouse on delete cascade, qty int not null);
create table "Shop-Inv".total (warehouse text primary key references "Shop-Inv".warehouse on delete cascade,
    qty bigint not null);
insert into "Shop-Inv".warehouse values ('Lyon, Est'), ('par 2'), ('Lyon'), ('Est');
insert into "Shop-Inv".stock (warehouse, qty) select code, 3 from "Shop-Inv".warehouse;
select lockstep.define_derived('totals', '"Shop-Inv".total', parent => '"Shop-Inv".warehouse', query => $q$
    select w.code as warehouse, coalesce(sum(s.qty), 0)::bigint as qty
    from "Shop-Inv".warehouse w left join "Shop-Inv".stock s on s.warehouse = w.code group by w.code $q$);
select lockstep.recompute('totals');
update "Shop-Inv".stock set qty = 5 where warehouse = 'Lyon, Est';
"""


def lockstep(dsn: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "lockstep", *args, "--dsn", dsn], capture_output=True, text=True, timeout=60
    )


def test_a_key_with_a_comma_is_given_with_a_backslash(conn, dsn):
    """`--keys 'Lyon, Est'` verified the parents 'Lyon' and 'Est' and said the table matched."""
    conn.execute(SHOP)
    p = lockstep(dsn, "verify", "totals", "--keys", "Lyon\\, Est", "--json")
    assert p.returncode == 1, p.stdout + p.stderr
    out = json.loads(p.stdout)
    assert out["keys"] == ["Lyon, Est"] and out["different"] == 1, out
    p = lockstep(dsn, "diff", "totals", "--keys", "par 2,Lyon\\, Est", "--json")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["actions"]["update"]["examples"] == [{"key": "Lyon, Est", "rows": 1}]
    p = lockstep(dsn, "verify", "totals", "--keys", "Lyon,Est")
    assert p.returncode == 0 and "(2 parents)" in p.stdout, p.stdout + p.stderr


def test_a_diff_over_keys_that_would_not_change_says_so(conn, dsn):
    """With --keys, "a recompute now would write nothing" named the wrong thing: a pass over those keys."""
    conn.execute(SHOP)
    p = lockstep(dsn, "diff", "totals", "--keys", "par 2")
    assert p.returncode == 0, p.stderr
    said = "totals: no difference: a worker pass over these 1 parent(s) would write nothing"
    assert p.stdout.strip() == said, p.stdout
    conn.execute("select lockstep.recompute('totals')")
    p = lockstep(dsn, "diff", "totals")
    assert p.stdout.strip() == "totals: no difference: a recompute now would write nothing", p.stdout


TENANTS = """
create table region (tenant text not null, id int not null, primary key (tenant, id));
create type region_key as (tenant text, id int);
create table region_total (tenant text not null, id int not null, n int not null, primary key (tenant, id),
    foreign key (tenant, id) references region on delete cascade on update cascade);
create function region_totals(keys region_key[]) returns table (tenant text, id int, n int)
    language sql stable
    as $$ select r.tenant, r.id, 1 from public.region r
          where keys is null or row(r.tenant, r.id)::public.region_key = any(keys) $$;
insert into region values ('a', 1), ('a', 2), ('Lyon, Est', 1), ('q"x', 3);
select lockstep.define_derived('regions', 'region_total', 'region_totals(region_key[])', 'region');
select lockstep.recompute('regions');
delete from region_total where (tenant, id) in (('a', 2), ('Lyon, Est', 1), ('q"x', 3));
"""


def test_composite_keys_are_given_as_record_text_their_commas_inside(conn, dsn):
    """A composite key's text always holds a comma: `--keys '(a,1)'` was split into '(a' and '1)', which no
    key type reads. A comma inside a key's parentheses or double quotes is part of the key."""
    conn.execute(TENANTS)
    p = lockstep(dsn, "verify", "regions", "--keys", "(a,1),(a,2)", "--json")
    assert p.returncode == 1, p.stdout + p.stderr
    out = json.loads(p.stdout)
    assert out["keys"] == ["(a,1)", "(a,2)"] and out["missing"] == 1, out
    p = lockstep(dsn, "diff", "regions", "--keys", '("Lyon, Est",1), ("q""x",3)', "--json")
    assert p.returncode == 0, p.stderr
    examples = json.loads(p.stdout)["actions"]["insert"]["examples"]
    assert sorted(e["key"] for e in examples) == ['("Lyon, Est",1)', '("q""x",3)'], examples
    p = lockstep(dsn, "verify", "regions", "--keys", "(a,1)")
    assert p.returncode == 0 and "(1 parent)" in p.stdout, p.stdout + p.stderr
