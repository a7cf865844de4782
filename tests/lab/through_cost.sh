#!/usr/bin/env bash
# The cost of a watch through a join, side by side with pgbench: writes of order_line unwatched (base),
# watched directly on its customer_id (plain), watched on order_id through orders by the shared trigger
# function lockstep.enqueue_through (shared: what a role that may not create in schema lockstep gets) and
# by the function watch() generates for it (through). Each
# scenario runs SECS seconds (default 8) with 4 clients, single-row UPDATEs (upd) then INSERTs (ins); two
# rounds, the second in reverse order. A scratch database is created and dropped.
# Usage: PATH=.venv/bin:$PATH SECS=8 tests/lab/through_cost.sh
set -euo pipefail
DB=lockstep_through_$$
B=$(pg_config --bindir)
H=${PGHOST:-127.0.0.1}
P="psql -X -q -v ON_ERROR_STOP=1 -h $H -d $DB"
W=$(mktemp -d)
trap 'dropdb -h $H --if-exists $DB; rm -rf $W' EXIT
createdb -h $H $DB
lockstep migrate --dsn "host=$H dbname=$DB" >/dev/null 2>&1
$P >/dev/null 2>&1 <<'SQL'
create table customer (id bigint primary key);
create table orders (id bigint primary key, customer_id bigint not null references customer(id));
create index on orders (customer_id);
create table order_line (id bigint primary key, order_id bigint not null references orders(id),
                         customer_id bigint not null references customer(id), amount int not null);
create index on order_line (order_id);
insert into customer select g from generate_series(1, 10000) g;
insert into orders select g, 1 + g % 10000 from generate_series(1, 100000) g;
insert into order_line select g, 1 + g % 100000, 1 + (1 + g % 100000) % 10000, 0 from generate_series(1, 1000000) g;
create table customer_total (customer_id bigint primary key references customer(id) on delete cascade, total bigint not null);
create function customer_total_compute(keys bigint[]) returns table (customer_id bigint, total bigint)
language sql stable as $$ select l.customer_id, sum(l.amount)::bigint from public.order_line l
  where keys is null or l.customer_id = any(keys) group by 1 $$;
select lockstep.define_derived('ct', 'public.customer_total', 'public.customer_total_compute(bigint[])', parent => 'public.customer', every => '1 day');
vacuum analyze;
create sequence ol_seq start 2000000;
SQL
cat > $W/upd.pgb <<'PGB'
\set id random(1, 1000000)
update order_line set amount = amount + 1 where id = :id;
PGB
cat > $W/ins.pgb <<'PGB'
\set o random(1, 100000)
insert into order_line (id, order_id, customer_id, amount) values (nextval('ol_seq'), :o, 1 + :o % 10000, 1);
PGB
SECS=${SECS:-8}
plain="select lockstep.watch('ct', 'order_line', 'customer_id')"
through="select lockstep.watch('ct', 'order_line', 'order_id', through => 'orders', through_column => 'customer_id')"
# the through watch's triggers on order_line moved to the shared function, with the same arguments
shared="do \$\$ declare t record; begin
    for t in select tgname, pg_get_triggerdef(oid) def from pg_trigger
             where tgrelid = 'order_line'::regclass and tgnargs = 6 loop
        execute format('drop trigger %I on order_line', t.tgname);
        execute regexp_replace(t.def, 'lockstep\.enqueue_w_[0-9a-f]+', 'lockstep.enqueue_through');
    end loop; end \$\$"
off="select lockstep.unwatch('ct', 'order_line'); select lockstep.unwatch('ct', 'orders');
     truncate lockstep.queue, lockstep.through_entry; delete from lockstep.recompute_flag"
for round in 1 2; do
    order="base plain shared through"; [ $round = 2 ] && order="through shared plain base"
    for sc in $order; do
        for script in upd ins; do
            $P -c "$off" >/dev/null 2>&1 || true
            case $sc in
                plain) $P -c "$plain" >/dev/null 2>&1 ;;
                through) $P -c "$through" >/dev/null 2>&1 ;;
                shared) $P -c "$through" >/dev/null 2>&1; $P -c "$shared" >/dev/null ;;
            esac
            $P -c "checkpoint" >/dev/null
            tps=$($B/pgbench -h $H -n -M prepared -c 4 -j 2 -T "$SECS" -f $W/$script.pgb $DB 2>/dev/null |
                  sed -n 's/^tps = \([0-9.]*\) (without.*/\1/p')
            fn=$($P -Atc "select string_agg(distinct tgfoid::regproc::text, ',') from pg_trigger
                          where tgrelid = 'order_line'::regclass and tgnargs >= 2")
            echo "round=$round scenario=$sc script=$script tps=$tps function=${fn:-none}"
        done
    done
done
