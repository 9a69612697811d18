package ai.sparkdl.bridge;

import java.io.Serializable;
import java.nio.ByteBuffer;
import java.nio.ByteOrder;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.Iterator;
import java.util.List;
import java.util.NoSuchElementException;

import org.apache.spark.api.java.JavaRDD;
import org.apache.spark.api.java.function.FlatMapFunction;
import org.apache.spark.rdd.RDD;
import org.apache.spark.sql.Dataset;
import org.apache.spark.sql.Row;
import org.apache.spark.sql.RowFactory;
import org.apache.spark.sql.catalyst.InternalRow;
import org.apache.spark.sql.catalyst.expressions.Alias;
import org.apache.spark.sql.catalyst.expressions.Attribute;
import org.apache.spark.sql.catalyst.expressions.AttributeReference;
import org.apache.spark.sql.catalyst.expressions.Expression;
import org.apache.spark.sql.catalyst.expressions.NamedExpression;
import org.apache.spark.sql.execution.ColumnarToRowExec;
import org.apache.spark.sql.execution.InputAdapter;
import org.apache.spark.sql.execution.ProjectExec;
import org.apache.spark.sql.execution.SparkPlan;
import org.apache.spark.sql.execution.WholeStageCodegenExec;
import org.apache.spark.sql.execution.adaptive.AdaptiveSparkPlanExec;
import org.apache.spark.sql.execution.adaptive.QueryStageExec;
import org.apache.spark.sql.execution.columnar.InMemoryTableScanExec;
import org.apache.spark.sql.types.DataType;
import org.apache.spark.sql.types.DataTypes;
import org.apache.spark.sql.types.StructField;
import org.apache.spark.sql.types.StructType;
import org.apache.spark.sql.vectorized.ColumnVector;
import org.apache.spark.sql.vectorized.ColumnarBatch;

/**
 * A prepared DataFrame of numeric scalar columns delivered in blocks of rows (issue 30): each output
 * row holds up to {@code blockRows} input rows as little-endian bytes, one binary column per group of
 * input columns, row-major (the features group is the rank's (rows, features) float32 block as
 * numpy views it). Spark's own Arrow delivery builds an array per row and writes it element by
 * element; here the executor reads each row's values once and the Arrow writer copies one buffer
 * per block. The grouping comes from Python ({@code groups[i]}: the output column of input column
 * i); every column of a group must have the same type, written as it is (float32, int32, int64).
 */
public final class PackedRows {
    private PackedRows() {
    }

    static final int FLOAT = 0;
    static final int INT = 1;
    static final int LONG = 2;

    /** The packed DataFrame, one partition per partition of {@code prepared} (the rows keep their order). */
    public static Dataset<Row> pack(Dataset<Row> prepared, int[] groups, String[] names, int blockRows) {
        StructField[] fields = prepared.schema().fields();
        if (groups.length != fields.length) {
            throw new IllegalArgumentException("groups has " + groups.length + " entries for " + fields.length
                    + " columns");
        }
        int[] kinds = new int[fields.length];
        for (int i = 0; i < fields.length; i++) {
            kinds[i] = kindOf(fields[i]);
        }
        StructField[] out = new StructField[names.length];
        for (int g = 0; g < names.length; g++) {
            out[g] = DataTypes.createStructField(names[g], DataTypes.BinaryType, false);
        }
        JavaRDD<Row> packed;
        ColumnarSource columnar = ColumnarSource.of(prepared.queryExecution().executedPlan(), fields.length);
        if (columnar != null) {
            packed = columnar.batches.toJavaRDD().mapPartitions(
                    new ColumnarPacker(kinds, groups, names.length, columnar.ordinals));
        } else {
            JavaRDD<InternalRow> rows = prepared.queryExecution().toRdd().toJavaRDD();
            packed = rows.mapPartitions(new Packer(kinds, groups, names.length, blockRows));
        }
        return prepared.sparkSession().createDataFrame(packed, new StructType(out));
    }

    /** Whether {@link #pack} reads the cached columns directly (for tests and logs). */
    public static boolean readsCachedColumns(Dataset<Row> prepared) {
        return ColumnarSource.of(prepared.queryExecution().executedPlan(), prepared.schema().fields().length) != null;
    }

    /**
     * A plan that only renames the columns of a cached relation (InMemoryTableScan under projections of
     * attributes, no casts, filters or anything else): its cached column batches can be read as they
     * are, without turning them into rows first.
     */
    static final class ColumnarSource {
        final RDD<ColumnarBatch> batches;
        final int[] ordinals; // output column i of the plan -> its column in the scan's batches

        private ColumnarSource(RDD<ColumnarBatch> batches, int[] ordinals) {
            this.batches = batches;
            this.ordinals = ordinals;
        }

        static ColumnarSource of(SparkPlan plan, int columns) {
            List<Expression> outputs = new ArrayList<>();
            scala.collection.Iterator<Attribute> top = plan.output().iterator();
            while (top.hasNext()) {
                outputs.add(top.next());
            }
            SparkPlan node = plan;
            while (true) {
                if (node instanceof InMemoryTableScanExec) {
                    break;
                } else if (node instanceof AdaptiveSparkPlanExec) {
                    node = ((AdaptiveSparkPlanExec) node).executedPlan();
                } else if (node instanceof QueryStageExec) {
                    node = ((QueryStageExec) node).plan();
                } else if (node instanceof WholeStageCodegenExec) {
                    node = ((WholeStageCodegenExec) node).child();
                } else if (node instanceof InputAdapter) {
                    node = ((InputAdapter) node).child();
                } else if (node instanceof ColumnarToRowExec) {
                    node = ((ColumnarToRowExec) node).child();
                } else if (node instanceof ProjectExec) {
                    ProjectExec project = (ProjectExec) node;
                    List<Expression> below = new ArrayList<>();
                    for (Expression wanted : outputs) {
                        Expression found = null;
                        scala.collection.Iterator<NamedExpression> list = project.projectList().iterator();
                        while (list.hasNext()) {
                            NamedExpression named = list.next();
                            if (named.exprId().equals(((NamedExpression) wanted).exprId())) {
                                found = named instanceof Alias ? ((Alias) named).child() : (Expression) named;
                            }
                        }
                        if (!(found instanceof AttributeReference)) {
                            return null; // computed, not just renamed
                        }
                        below.add(found);
                    }
                    outputs = below;
                    node = project.child();
                } else {
                    return null;
                }
            }
            InMemoryTableScanExec scan = (InMemoryTableScanExec) node;
            if (!scan.supportsColumnar() || outputs.size() != columns) {
                return null;
            }
            List<Attribute> scanned = new ArrayList<>();
            scala.collection.Iterator<Attribute> out = scan.output().iterator();
            while (out.hasNext()) {
                scanned.add(out.next());
            }
            int[] ordinals = new int[columns];
            for (int i = 0; i < columns; i++) {
                ordinals[i] = -1;
                for (int j = 0; j < scanned.size(); j++) {
                    if (scanned.get(j).exprId().equals(((NamedExpression) outputs.get(i)).exprId())) {
                        ordinals[i] = j;
                    }
                }
                if (ordinals[i] < 0) {
                    return null;
                }
            }
            try {
                return new ColumnarSource(scan.executeColumnar(), ordinals);
            } catch (RuntimeException notColumnar) {
                return null;
            }
        }
    }

    /** One block per cached column batch: each column's values read in bulk, then laid out row-major. */
    static final class ColumnarPacker implements FlatMapFunction<Iterator<ColumnarBatch>, Row>, Serializable {
        private static final long serialVersionUID = 1L;
        private final int[] kinds;
        private final int[] groups;
        private final int groupCount;
        private final int[] ordinals;

        ColumnarPacker(int[] kinds, int[] groups, int groupCount, int[] ordinals) {
            this.kinds = kinds;
            this.groups = groups;
            this.groupCount = groupCount;
            this.ordinals = ordinals;
        }

        @Override
        public Iterator<Row> call(Iterator<ColumnarBatch> input) {
            return new Iterator<Row>() {
                @Override
                public boolean hasNext() {
                    return input.hasNext();
                }

                @Override
                public Row next() {
                    ColumnarBatch batch = input.next();
                    int rows = batch.numRows();
                    int[] rowBytes = new int[groupCount];
                    for (int i = 0; i < kinds.length; i++) {
                        rowBytes[groups[i]] += kinds[i] == LONG ? 8 : 4;
                    }
                    ByteBuffer[] out = new ByteBuffer[groupCount];
                    for (int g = 0; g < groupCount; g++) {
                        out[g] = ByteBuffer.allocate(rowBytes[g] * rows).order(ByteOrder.LITTLE_ENDIAN);
                    }
                    int[] offsets = new int[kinds.length]; // byte offset of column i inside its group's row
                    int[] used = new int[groupCount];
                    for (int i = 0; i < kinds.length; i++) {
                        offsets[i] = used[groups[i]];
                        used[groups[i]] += kinds[i] == LONG ? 8 : 4;
                    }
                    for (int i = 0; i < kinds.length; i++) {
                        ColumnVector vector = batch.column(ordinals[i]);
                        if (vector.hasNull()) {
                            throw new IllegalStateException("column " + i + " holds a null: the driver's checks "
                                    + "should have refused it");
                        }
                        ByteBuffer target = out[groups[i]];
                        int stride = rowBytes[groups[i]];
                        int at = offsets[i];
                        switch (kinds[i]) {
                            case FLOAT: {
                                float[] values = vector.getFloats(0, rows);
                                for (int r = 0; r < rows; r++) {
                                    target.putFloat(at + r * stride, values[r]);
                                }
                                break;
                            }
                            case INT: {
                                int[] values = vector.getInts(0, rows);
                                for (int r = 0; r < rows; r++) {
                                    target.putInt(at + r * stride, values[r]);
                                }
                                break;
                            }
                            default: {
                                long[] values = vector.getLongs(0, rows);
                                for (int r = 0; r < rows; r++) {
                                    target.putLong(at + r * stride, values[r]);
                                }
                                break;
                            }
                        }
                    }
                    Object[] values = new Object[groupCount];
                    for (int g = 0; g < groupCount; g++) {
                        values[g] = out[g].array();
                    }
                    return RowFactory.create(values);
                }
            };
        }
    }

    private static int kindOf(StructField field) {
        DataType type = field.dataType();
        if (type.equals(DataTypes.FloatType)) {
            return FLOAT;
        }
        if (type.equals(DataTypes.IntegerType)) {
            return INT;
        }
        if (type.equals(DataTypes.LongType)) {
            return LONG;
        }
        throw new IllegalArgumentException("column " + field.name() + " has type " + type.simpleString()
                + ": only float, int and bigint columns are packed");
    }

    static final class Packer implements FlatMapFunction<Iterator<InternalRow>, Row>, Serializable {
        private static final long serialVersionUID = 1L;
        private final int[] kinds;
        private final int[] groups;
        private final int groupCount;
        private final int blockRows;

        Packer(int[] kinds, int[] groups, int groupCount, int blockRows) {
            this.kinds = kinds;
            this.groups = groups;
            this.groupCount = groupCount;
            this.blockRows = Math.max(1, blockRows);
        }

        @Override
        public Iterator<Row> call(Iterator<InternalRow> input) {
            int[] rowBytes = new int[groupCount];
            for (int i = 0; i < kinds.length; i++) {
                rowBytes[groups[i]] += kinds[i] == LONG ? 8 : 4;
            }
            return new Iterator<Row>() {
                @Override
                public boolean hasNext() {
                    return input.hasNext();
                }

                @Override
                public Row next() {
                    if (!input.hasNext()) {
                        throw new NoSuchElementException();
                    }
                    ByteBuffer[] out = new ByteBuffer[groupCount];
                    for (int g = 0; g < groupCount; g++) {
                        out[g] = ByteBuffer.allocate(rowBytes[g] * blockRows).order(ByteOrder.LITTLE_ENDIAN);
                    }
                    int rows = 0;
                    while (rows < blockRows && input.hasNext()) {
                        InternalRow row = input.next();
                        for (int i = 0; i < kinds.length; i++) {
                            if (row.isNullAt(i)) {
                                throw new IllegalStateException("column " + i + " holds a null: the driver's "
                                        + "checks should have refused it");
                            }
                            ByteBuffer target = out[groups[i]];
                            switch (kinds[i]) {
                                case FLOAT: target.putFloat(row.getFloat(i)); break;
                                case INT: target.putInt(row.getInt(i)); break;
                                default: target.putLong(row.getLong(i)); break;
                            }
                        }
                        rows++;
                    }
                    Object[] values = new Object[groupCount];
                    for (int g = 0; g < groupCount; g++) {
                        byte[] bytes = out[g].array();
                        values[g] = rows == blockRows ? bytes : Arrays.copyOf(bytes, rows * rowBytes[g]);
                    }
                    return RowFactory.create(values);
                }
            };
        }
    }
}
