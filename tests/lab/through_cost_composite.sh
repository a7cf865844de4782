#!/usr/bin/env bash
# The cost of a watch through a join under a composite key, side by side with pgbench: writes of
# order_line unwatched (base), watched directly on its (tenant_id, customer_id) (plain), and watched on
# (tenant_id, order_id) through orders, through_columns (tenant_id, customer_id) (through). Each scenario
# runs SECS seconds (default 8) with 4 clients, single-row UPDATEs (upd) then INSERTs (ins); two rounds,
# the second in reverse order. A scratch database is created and dropped.
# Usage: PATH=.venv/bin:$PATH SECS=8 tests/lab/through_cost_composite.sh
set -euo pipefail
DB=lockstep_through_c_$$
B=$(pg_config --bindir)
H=${PGHOST:-127.0.0.1}
P="psql -X -q -v ON_ERROR_STOP=1 -h $H -d $DB"
W=$(mktemp -d)
trap 'dropdb -h $H --if-exists $DB; rm -rf $W' EXIT
createdb -h $H $DB
lockstep migrate --dsn "host=$H dbname=$DB" >/dev/null 2>&1
$P >/dev/null 2>&1 <<'SQL'
create table customer (tenant_id int not null, id bigint not null, primary key (tenant_id, id));
create table orders (tenant_id int not null, id bigint not null, customer_id bigint not null,
                     primary key (tenant_id, id), foreign key (tenant_id, customer_id) references customer);
create index on orders (tenant_id, customer_id);
create table order_line (tenant_id int not null, id bigint not null, order_id bigint not null,
                         customer_id bigint not null, amount int not null, primary key (tenant_id, id),
                         foreign key (tenant_id, order_id) references orders,
                         foreign key (tenant_id, customer_id) references customer);
create index on order_line (tenant_id, order_id);
insert into customer select 1 + g % 10, g from generate_series(1, 10000) g;
insert into orders select 1 + (1 + g % 10000) % 10, g, 1 + g % 10000 from generate_series(1, 100000) g;
insert into order_line select 1 + (1 + (1 + g % 100000) % 10000) % 10, g, 1 + g % 100000,
                              1 + (1 + g % 100000) % 10000, 0 from generate_series(1, 1000000) g;
create table customer_total (tenant_id int not null, customer_id bigint not null, total bigint not null,
                             primary key (tenant_id, customer_id),
                             foreign key (tenant_id, customer_id) references customer on delete cascade);
select lockstep.define_derived('ct', 'public.customer_total', parent => 'public.customer', every => '1 day',
    query => 'select l.tenant_id, l.customer_id, sum(l.amount)::bigint as total from public.order_line l group by 1, 2');
vacuum analyze;
create sequence ol_seq start 2000000;
SQL
cat > $W/upd.pgb <<'PGB'
\set id random(1, 1000000)
update order_line set amount = amount + 1 where tenant_id = 1 + (1 + (1 + :id % 100000) % 10000) % 10 and id = :id;
PGB
cat > $W/ins.pgb <<'PGB'
\set o random(1, 100000)
insert into order_line values (1 + (1 + :o % 10000) % 10, nextval('ol_seq'), :o, 1 + :o % 10000, 1);
PGB
SECS=${SECS:-8}
plain="select lockstep.watch('ct', 'order_line', key_columns => array['tenant_id', 'customer_id']::name[])"
through="select lockstep.watch('ct', 'order_line', key_columns => array['tenant_id', 'order_id']::name[],
         through => 'orders', through_columns => array['tenant_id', 'customer_id']::name[])"
off="select lockstep.unwatch('ct', 'order_line'); select lockstep.unwatch('ct', 'orders');
     truncate lockstep.queue, lockstep.through_entry; delete from lockstep.recompute_flag"
for round in 1 2; do
    order="base plain through"; [ $round = 2 ] && order="through plain base"
    for sc in $order; do
        for script in upd ins; do
            $P -c "$off" >/dev/null 2>&1 || true
            case $sc in
                plain) $P -c "$plain" >/dev/null 2>&1 ;;
                through) $P -c "$through" >/dev/null 2>&1 ;;
            esac
            $P -c "checkpoint" >/dev/null
            tps=$($B/pgbench -h $H -n -M prepared -c 4 -j 2 -T "$SECS" -f $W/$script.pgb $DB 2>/dev/null |
                  sed -n 's/^tps = \([0-9.]*\) (without.*/\1/p')
            fn=$($P -Atc "select string_agg(distinct tgfoid::regproc::text, ',') from pg_trigger
                          where tgrelid = 'order_line'::regclass and not tgisinternal")
            queued=$($P -Atc "select count(*) from lockstep.queue")
            echo "round=$round scenario=$sc script=$script tps=$tps function=${fn:-none} queued=$queued"
        done
    done
done
